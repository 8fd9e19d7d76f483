"""metrics.jsonl (one JSON object per logged step or evaluation) plus Accelerate's trackers."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from mae.run_folder import METRICS


class MetricsWriter:
    """Appends to `output_dir/metrics.jsonl` on the main process and forwards to the trackers."""

    def __init__(self, accelerator: Accelerator, output_dir: str | Path) -> None:
        self.accelerator = accelerator
        self.path = Path(output_dir) / METRICS

    def write(self, record: dict[str, Any]) -> None:
        if not self.accelerator.is_main_process:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
        numbers = {k: v for k, v in clean.items() if isinstance(v, (int, float)) and k != "step"}
        if self.accelerator.trackers:
            self.accelerator.log(numbers, step=record.get("step"))

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines logged after the checkpoint, so the file reads as one run."""
        if not self.accelerator.is_main_process or not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))


def report_bad_files(accelerator: Accelerator, pending: list[tuple[str, str]], seen: list[str]) -> None:
    """Warn once per file that failed to decode (on the main process, whatever process or worker met
    it) and add it to `seen`; every process calls this together."""
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        pending = gather_object(pending)
    known = set(seen)
    for name, reason in pending:
        if name not in known:
            known.add(name)
            seen.append(name)
            if accelerator.is_main_process:
                warnings.warn(f"skipping unreadable image {name}: {reason}", stacklevel=2)
