"""Evaluation and calibration data."""
