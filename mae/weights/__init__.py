"""Weights in and out: every checkpoint format read (`importers`), encoders and classifiers written (`export`)."""
