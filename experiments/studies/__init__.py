"""The registry of studies: `STUDIES[name]` is an `experiments.protocol.Study`."""

from experiments.studies import mqar, relcomp

STUDIES = {study.name: study for study in (relcomp.BINARY, relcomp.TERNARY, mqar.MQAR)}

__all__ = ["STUDIES"]
