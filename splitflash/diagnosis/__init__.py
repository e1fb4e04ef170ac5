"""Diagnosis of a running deployment: pure anomaly rules over measured rows (findings.py,
rules.py, rows.py) and the measurement run that feeds them (probe.py, doctor.py: I/O)."""

from splitflash.diagnosis.findings import Finding, PolicyInfo, parse_policy
from splitflash.diagnosis.rules import diagnose

__all__ = ["Finding", "PolicyInfo", "diagnose", "parse_policy"]
