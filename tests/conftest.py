"""Suite-wide settings. Hypothesis' per-example deadline (200 ms) and its too-slow health
check measure the machine, not the code: one core shared with a second copy of the suite can
stall an example past either. Tests that set their own ``settings`` still override the rest."""

from hypothesis import HealthCheck, settings

settings.register_profile("any-machine", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("any-machine")

from tests.otlp_receiver import receiver  # noqa: E402, F401 - the tracing tests' fixture
