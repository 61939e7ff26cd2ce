import pytest

from carlskit.cluster import worker_environment
from carlskit.cluster._environment import apply_environment, merge_xla_flags


def test_thread_limits_follow_threads_per_worker():
    environment = worker_environment(threads=3)
    assert environment["OMP_NUM_THREADS"] == "3"
    assert environment["OPENBLAS_NUM_THREADS"] == "3"
    assert environment["MKL_NUM_THREADS"] == "3"
    assert environment["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert "JAX_PLATFORMS" not in environment
    assert "XLA_FLAGS" not in environment


def test_single_thread_turns_off_xla_eigen_threads_and_sets_platform():
    environment = worker_environment(threads=1, platform="cpu")
    assert environment["XLA_FLAGS"] == "--xla_cpu_multi_thread_eigen=false"
    assert environment["JAX_PLATFORMS"] == "cpu"


@pytest.mark.parametrize("threads, error", [(0, ValueError), (-1, ValueError), (1.5, TypeError),
                                            (True, TypeError), ("2", TypeError)])
def test_bad_threads_is_a_type_error_for_a_non_int_and_a_value_error_below_one(threads, error):
    with pytest.raises(error, match="threads"):
        worker_environment(threads=threads)


def test_unknown_platform_is_a_value_error():
    with pytest.raises(ValueError, match="platform"):
        worker_environment(platform="quantum")


def test_xla_flags_are_merged_not_replaced():
    merged = merge_xla_flags(
        "--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=true",
        "--xla_cpu_multi_thread_eigen=false --xla_dump_to=/tmp/x",
    )
    assert merged.split() == [
        "--xla_force_host_platform_device_count=8",
        "--xla_cpu_multi_thread_eigen=true",
        "--xla_dump_to=/tmp/x",
    ]
    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    apply_environment({"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false", "OMP_NUM_THREADS": "2"}, environ)
    assert environ == {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false",
        "OMP_NUM_THREADS": "2",
    }


def test_importing_carlskit_and_its_worker_plugin_does_not_import_jax():
    import subprocess
    import sys

    code = ("import sys, carlskit, carlskit.cluster._environment; "
            "assert 'jax' not in sys.modules, 'jax was imported'; carlskit.Trainer; "
            "assert 'jax' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
