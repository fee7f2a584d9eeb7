"""Row-invariant kernels (`Tuning.row_invariant`): matmul.py, norm.py, attention.py, mla.py."""
