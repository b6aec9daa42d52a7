"""Runs pytest over this folder (ctest's `python` test); exits 77 (skipped) when pytest or torch is missing."""
import os
import sys

try:
    import pytest
    import torch  # noqa: F401
except ImportError as e:
    print(f"python tests skipped: {e}")
    sys.exit(77)

sys.exit(pytest.main([os.path.dirname(os.path.abspath(__file__)), "-p", "no:cacheprovider", *sys.argv[1:]]))
