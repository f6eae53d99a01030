"""The registry of studies: `STUDIES[name]` is an `experiments.protocol.Study`."""

from experiments.studies import code_lm, cpm3, mqar, multikey, polyfilter, relcomp

STUDIES = {
  study.name: study
  for study in (
    relcomp.BINARY,
    relcomp.TERNARY,
    mqar.MQAR,
    cpm3.CPM3,
    cpm3.CPM3_MLP,
    polyfilter.POLYFILTER,
    multikey.MULTIKEY,
    code_lm.CODE_LM,
  )
}

__all__ = ["STUDIES"]
