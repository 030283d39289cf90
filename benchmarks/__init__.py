"""Benchmarks: keyserial against the patterns Python users actually use, as ratios in one run.

Run ``python -m benchmarks`` (after ``pip install -e ".[bench]"``); ``--quick`` runs tiny sizes.
"""
