"""``derive_seed``: one function for every random stream of a run."""

import pytest

from megatron_oar.seeds import NAMESPACES, SEED_SPACE, derive_seed


def test_a_stream_is_a_function_of_what_identifies_it():
    assert derive_seed("rollout", 0, 3, 0, 5) == derive_seed("rollout", 0, 3, 0, 5)
    assert derive_seed("rollout", 0, 3, 0, 5) != derive_seed("rollout", 0, 3, 0, 6)
    # the parts are kept apart: (1, 23) and (12, 3) are different streams
    assert derive_seed("eval", 1, 23) != derive_seed("eval", 12, 3)


def test_namespaces_do_not_share_streams():
    seeds = {derive_seed(ns, 0, 1, 2) for ns in NAMESPACES}
    assert len(seeds) == len(NAMESPACES)


def test_range_leaves_room_for_vllm_completion_offsets():
    seeds = [derive_seed("engine", 0, 0, call, i) for call in range(50) for i in range(50)]
    assert all(0 <= s < SEED_SPACE for s in seeds) and SEED_SPACE + 2**20 <= 2**31
    assert len(set(seeds)) == len(seeds)


def test_unknown_namespace_is_refused():
    with pytest.raises(ValueError, match="unknown namespace 'rollouts'"):
        derive_seed("rollouts", 0)
