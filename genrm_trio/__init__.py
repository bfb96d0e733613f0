"""genrm-trio: a Trio GenRM cohort judging server, wire-compatible with NeMo Gym's genrm_compare."""

__version__ = "0.1.0"
