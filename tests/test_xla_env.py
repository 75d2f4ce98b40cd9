"""The tests' XLA flags: a quick-compile flag that the installed XLA does not know is left out
(XLA aborts any process whose XLA_FLAGS name one), the others kept."""

from tests import xla_env


def test_a_flag_this_xla_does_not_know_is_left_out(monkeypatch):
  monkeypatch.delenv(xla_env._KNOWN_ENV, raising=False)  # pylint: disable=protected-access
  monkeypatch.setattr(xla_env, 'QUICK_COMPILE',
                      '--xla_backend_optimization_level=0 --xla_spsjax_no_such_flag=1')
  assert xla_env.known_quick_compile() == '--xla_backend_optimization_level=0'
  assert xla_env.flags(devices=2) == ('--xla_backend_optimization_level=0 '
                                      '--xla_force_host_platform_device_count=2')
