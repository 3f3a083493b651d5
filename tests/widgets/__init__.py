"""Tests of the config panel and the launch status panel (in-process, and in a real browser)."""
