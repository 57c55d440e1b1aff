"""The optimiser recipe and run length that ``seqlab nnqs`` takes when flags are left out."""

from __future__ import annotations

from seqlab.nnqs.recipe import (RANDOM_START, SAMPLED_SAMPLES, SELECTED_SAMPLES, SELECTED_SUM, SELECTED_SUM_STEPS,
                                 WARM_START, default_samples, default_steps, recipe_for)
from seqlab.nnqs.space import n_configurations
from seqlab.nnqs.vmc import VMCConfig, takes_selected_sum


def test_run_length_follows_the_sector_size():
    # STO-3G sectors: H2O has 7 orbitals and 5+5 electrons, NH3 8 and 5+5, N2 10 and 7+7, C2 10 and 6+6
    assert default_steps(n_configurations(2, 1, 1)) == 400
    assert default_steps(n_configurations(7, 5, 5)) == 400  # 441 determinants
    assert default_steps(n_configurations(8, 5, 5)) == 1000  # 3 136
    assert default_steps(n_configurations(10, 7, 7)) == 2500  # 14 400
    assert default_steps(n_configurations(10, 6, 6)) == 2500  # 44 100
    assert [default_steps(n) for n in (999, 1000, 9999, 10000)] == [400, 1000, 1000, 2500]
    assert default_steps(1_656_369, selected_sum=True) == SELECTED_SUM_STEPS  # H2O/6-31G


def test_each_start_gets_its_own_recipe():
    assert recipe_for("none") is RANDOM_START and recipe_for("ccsd") is recipe_for("cisd") is recipe_for("hf") is WARM_START
    assert WARM_START.anneal == 0 and RANDOM_START.anneal > 0
    assert WARM_START.lr < RANDOM_START.lr  # a fitted state is kicked out by the random start's rate
    # the selected sum keeps the fitted state: a lower rate, the phase MLP at 1x, the guard from the first step
    assert recipe_for("ccsd", selected_sum=True) is SELECTED_SUM
    assert recipe_for("none", selected_sum=True) is RANDOM_START
    assert SELECTED_SUM.lr < WARM_START.lr and SELECTED_SUM.phase_lr_scale == 1.0 and SELECTED_SUM.rollback_after == 0
    # ... and its steps are L-BFGS iterations with the signs refitted; the others keep AdamW and no sign fit
    assert SELECTED_SUM.lbfgs and SELECTED_SUM.selected_sign_fit > 0
    assert not WARM_START.lbfgs and not RANDOM_START.lbfgs and WARM_START.selected_sign_fit == 0


def test_the_cli_knows_before_building_anything_whether_steps_take_the_selected_sum():
    limit = VMCConfig.sector_max
    assert takes_selected_sum("auto", "exact", 1_656_369, limit)
    assert not takes_selected_sum("auto", "exact", 14_400, limit)
    assert takes_selected_sum("selected-sum", "exact", 225, limit)
    assert not takes_selected_sum("auto", "sample-space", 1_656_369, limit)
    assert not takes_selected_sum("auto", "exact", 1_656_369, 0)  # the fast path disabled: sampled, as before
    assert not takes_selected_sum("sampled", "exact", 1_656_369, limit)


def test_default_samples_are_finite_past_the_sector_fast_path():
    """Past ``sector_max`` a sampled step's unique samples each cost a local energy over their connected
    configurations: N_s = 1e10 there drew ~1e5 unique samples of H2O/6-31G and ran out of memory, so the sampled
    default drops to a few thousand. The selected sum (``auto`` there) sums over what it samples: N_s = 1e6."""
    limit = VMCConfig.sector_max
    assert default_samples(14_400, limit) == 10**10  # N2: the exact sum, N_s unused
    assert default_samples(1_656_369, limit, "sampled") == SAMPLED_SAMPLES <= 10_000  # H2O/6-31G
    assert default_samples(1_656_369, limit) == default_samples(1_656_369, limit, "selected-sum") == SELECTED_SAMPLES
    assert SELECTED_SAMPLES <= 10**7
    assert default_samples(limit, limit) == 10**10
    assert default_samples(limit + 1, limit, "sampled") == SAMPLED_SAMPLES
