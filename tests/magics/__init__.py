"""Tests of the IPython magics, in-process and in a real kernel."""
