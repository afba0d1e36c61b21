"""Calibration: text sources, fixed-length token samples, layer input capture, Hessians, imatrices."""
