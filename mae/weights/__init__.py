"""Weights in and out: every checkpoint format read (`importers`: `load_pretrained`, `read_encoder`), encoders
written (`export`), classifiers written and read (`classifier`), and the file helpers they share (`files`)."""
