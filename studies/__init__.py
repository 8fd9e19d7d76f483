"""The studies behind the recipes and the results pages: each runs stages through `mae`'s public Python API with
one shared harness (`studies.harness`). Run from the repository root, e.g. `python -m studies.anomaly --help`; not
part of the installed package.
"""
