import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from carlskit.lopt import HierarchicalRule, LearnableAdam, LearnableAdamRule, LearnedOptimizer, MLPUpdateRule

SMALL_RULE = MLPUpdateRule(hidden_sizes=(8,))
RULES, RULE_IDS = [SMALL_RULE, LearnableAdamRule(), HierarchicalRule(hidden_size=8)], ["mlp", "adam", "hierarchical"]


def _odd_params():
    return {
        "dense": {"w": jnp.ones((3, 4), jnp.float32), "b": jnp.zeros((4,), jnp.bfloat16)},
        "list": [jnp.full((), 2.0, jnp.float32), jnp.arange(8, dtype=jnp.float16).reshape(2, 2, 2)],
        "tuple": (jnp.linspace(-1, 1, 5, dtype=jnp.float32),),
    }


@pytest.mark.parametrize("rule", RULES, ids=RULE_IDS)
def test_updates_keep_shapes_and_dtypes_of_any_pytree(rule):
    params = _odd_params()
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.5, params)
    optimizer = LearnedOptimizer(rule, rule.init_meta_params(jax.random.PRNGKey(0)))
    tx = optimizer.as_optax()
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert jax.tree.structure(updates) == jax.tree.structure(params)
    for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params)):
        assert u.shape == p.shape and u.dtype == p.dtype
        assert bool(jnp.all(jnp.isfinite(u.astype(jnp.float32))))
    assert int(state["step"]) == 1


def test_optax_adapter_inside_chain_with_clipping():
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones((3,))}
    grads = jax.tree.map(lambda p: 100.0 * jnp.ones_like(p), params)
    optimizer = LearnedOptimizer(SMALL_RULE, SMALL_RULE.init_meta_params(jax.random.PRNGKey(1)))
    chained = optax.chain(optax.clip_by_global_norm(1.0), optimizer.as_optax())
    state = chained.init(params)
    updates, state = chained.update(grads, state, params, loss=jnp.asarray(3.0))  # extra arg accepted
    # Reference: clip by hand, then the bare rule.
    clipped, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
    expected, _ = SMALL_RULE.update(optimizer.meta_params, SMALL_RULE.init_state(params), clipped, params)
    for got, want in zip(jax.tree.leaves(updates), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    # The momenta saw the clipped gradient, not the raw one.
    assert float(jnp.max(jnp.abs(state[1]["momenta"]["w"]))) < 1.0


def test_as_optax_requires_params_and_meta_params():
    tx = LearnableAdam().as_optax()
    params = {"x": jnp.ones(3)}
    with pytest.raises(ValueError, match="params"):
        tx.update(params, tx.init(params))
    with pytest.raises(ValueError, match="meta_params"):
        LearnedOptimizer(SMALL_RULE).as_optax()
    with pytest.raises(TypeError, match="meta_params"):
        LearnedOptimizer(SMALL_RULE).as_optax({"wrong": jnp.zeros(2)})
    with pytest.raises(ValueError, match="num_steps"):
        LearnableAdam().as_optax(num_steps=0)


def test_untrained_mlp_rule_descends_like_momentum():
    rule = MLPUpdateRule(initial_learning_rate=0.05)
    optimizer = LearnedOptimizer(rule)
    optimizer.meta_params = optimizer.init(jax.random.PRNGKey(0))
    tx = optimizer.as_optax()
    params = {"x": jnp.linspace(-2.0, 2.0, 16)}
    loss = lambda p: jnp.sum(p["x"] ** 2)
    state = tx.init(params)
    start = loss(params)
    for _ in range(30):
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        params = optax.apply_updates(params, updates)
    assert float(loss(params)) < 0.5 * float(start)


def test_learnable_adam_matches_optax_adam():
    params = {"w": jnp.linspace(-1.0, 1.0, 7)}
    grads = {"w": jnp.linspace(0.3, -0.2, 7)}
    ours, reference = LearnableAdam().as_optax(), optax.adam(1e-3)
    s1, s2 = ours.init(params), reference.init(params)
    for _ in range(3):
        u1, s1 = ours.update(grads, s1, params)
        u2, s2 = reference.update(grads, s2, params)
        np.testing.assert_allclose(u1["w"], u2["w"], rtol=1e-5, atol=1e-9)


def test_untrained_hierarchical_rule_is_optax_adam_and_its_meta_parameters_act():
    """Peer check: with the zero output layer it ships untrained, HierarchicalRule is optax.adam at
    ``initial_learning_rate`` on a multi-tensor tree; moving the output layer changes the step size
    (``a``) and the direction mix (``c_j``) as documented."""
    rule = HierarchicalRule(hidden_size=8, initial_learning_rate=3e-2)
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.linspace(0.5, -0.5, 4)}

    def run(tx, steps=6):
        p, state = params, tx.init(params)
        for i in range(steps):
            grads = jax.tree.map(lambda x: jnp.sin(3.0 * x + i), p)
            updates, state = tx.update(grads, state, p)
            p = optax.apply_updates(p, updates)
        return p

    theta = rule.init_meta_params(jax.random.PRNGKey(0))
    ours, reference = run(LearnedOptimizer(rule, theta).as_optax()), run(optax.adam(3e-2))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # log step size a = log 2 on every tensor: the first update is exactly twice Adam's
    doubled = {**theta, "out": {**theta["out"], "b": theta["out"]["b"].at[0].set(jnp.log(2.0))}}
    grads = jax.tree.map(lambda x: jnp.cos(x), params)
    base, _ = rule.update(theta, rule.init_state(params), grads, params)
    twice, _ = rule.update(doubled, rule.init_state(params), grads, params)
    for a, b in zip(jax.tree.leaves(twice), jax.tree.leaves(base)):
        np.testing.assert_allclose(a, 2.0 * b, rtol=1e-5)
    # c on the parameter direction p / rms(p): a decoupled weight decay pulling every entry to 0
    decay = {**theta, "out": {**theta["out"], "b": theta["out"]["b"].at[rule.num_directions].set(1.0)}}
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = rule.update(decay, rule.init_state(params), zero_grads, params)
    for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params)):
        assert np.all(np.asarray(u) * np.asarray(p) <= 0) and float(jnp.abs(u).max()) > 0


def test_hierarchical_rule_round_trips_through_a_file_and_checks_its_fields(tmp_path):
    rule = HierarchicalRule(hidden_size=4, decays=(0.5, 0.9), initial_learning_rate=1e-2)
    optimizer = LearnedOptimizer(rule, rule.init_meta_params(jax.random.PRNGKey(1)), train_horizon=50)
    loaded = LearnedOptimizer.load(optimizer.save(None, tmp_path / "h"))
    assert loaded.rule == rule and loaded.train_horizon == 50
    for a, b in zip(jax.tree.leaves(loaded.meta_params), jax.tree.leaves(optimizer.meta_params)):
        np.testing.assert_array_equal(a, b)
    for kwargs, message in (({"hidden_size": 0}, "hidden_size"), ({"decays": (1.0,)}, "decays"),
                            ({"second_moment_decay": 1.0}, "second_moment_decay"), ({"epsilon": 0.0}, "epsilon"),
                            ({"initial_learning_rate": -1.0}, "initial_learning_rate")):
        with pytest.raises(ValueError, match=message):
            HierarchicalRule(**kwargs)


def test_rule_validates_configuration():
    with pytest.raises(ValueError, match="hidden_sizes"):
        MLPUpdateRule(hidden_sizes=())
    with pytest.raises(ValueError, match="decays"):
        MLPUpdateRule(decays=(1.5,))


def test_mlp_rule_matches_per_entry_formula():
    # NumPy reference of the docstring, entry by entry: features [g, p, m_k] each divided by its
    # RMS over the tensor, time features tanh(t/s - 1), MLP + linear skip, step d * exp(a/1000) / 1000.
    from carlskit.lopt._rules import TIME_SCALES

    rule = MLPUpdateRule(hidden_sizes=(8, 8))
    meta = jax.tree.map(np.asarray, rule.init_meta_params(jax.random.PRNGKey(2)))
    meta["skip"] = meta["skip"] + np.random.default_rng(0).normal(size=meta["skip"].shape).astype(np.float32)
    rng = np.random.default_rng(1)
    params = {"w": rng.normal(size=(3, 5)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32)}
    grads = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
    state = rule.init_state(params)
    state = {"momenta": jax.tree.map(lambda m: rng.normal(size=m.shape).astype(np.float32), state["momenta"]),
             "step": jnp.asarray(7, jnp.int32)}
    updates, new_state = jax.jit(rule.update)(meta, state, grads, params)
    time_features = np.tanh(7.0 / np.asarray(TIME_SCALES) - 1.0)
    decays = np.asarray(rule.decays)[:, None]
    for name in params:
        g, p = grads[name].reshape(-1), params[name].reshape(-1)
        momenta = decays * np.asarray(state["momenta"][name]).reshape(len(rule.decays), -1) + (1 - decays) * g
        rows = np.concatenate([g[None], p[None], momenta])
        rows = rows / np.sqrt(np.mean(rows**2, axis=1, keepdims=True) + 1e-5)
        for i in range(g.size):
            x = np.concatenate([rows[:, i], time_features])
            h = x
            for layer in meta["layers"][:-1]:
                h = np.maximum(h @ layer["w"] + layer["b"], 0.0)
            out = h @ meta["layers"][-1]["w"] + meta["layers"][-1]["b"] + x @ meta["skip"]
            want = -out[0] * np.exp(1e-3 * out[1]) * 1e-3
            np.testing.assert_allclose(np.asarray(updates[name]).reshape(-1)[i], want, rtol=1e-4, atol=1e-8)
        np.testing.assert_allclose(np.asarray(new_state["momenta"][name]).reshape(len(rule.decays), -1), momenta,
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rule", RULES, ids=RULE_IDS)
def test_as_optax_refuses_integer_and_complex_params_naming_the_leaf(rule):
    tx = LearnedOptimizer(rule, rule.init_meta_params(jax.random.PRNGKey(0))).as_optax()
    good = {"w": jnp.ones((2, 3), jnp.float32)}
    for bad_leaf in (jnp.arange(3, dtype=jnp.int32), jnp.ones(3, jnp.complex64)):
        params = {**good, "b": bad_leaf}
        with pytest.raises(TypeError, match=r"params\['b'\].*dtype"):
            tx.init(params)
        with pytest.raises(TypeError, match=r"params\['b'\].*dtype"):
            tx.update(params, tx.init(good), params)


@pytest.mark.parametrize("rule", RULES, ids=RULE_IDS)
def test_update_compares_grads_params_and_state_leaf_by_leaf(rule):
    tx = LearnedOptimizer(rule, rule.init_meta_params(jax.random.PRNGKey(0))).as_optax()
    update = jax.jit(tx.update)  # the checks run when tracing, so they hold under jit too
    params = {"w": jnp.ones((2, 2)), "b": jnp.ones((3,))}
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"grads\['b'\]: shape \(4,\), params\['b'\] \(3,\)"):
        update({"w": jnp.ones((2, 2)), "b": jnp.ones((4,))}, state, params)
    with pytest.raises(ValueError, match=r"grads\['w'\]: shape \(2, 3\), params\['w'\] \(2, 2\)"):
        update({"w": jnp.ones((2, 3)), "b": jnp.ones((3,))}, state, params)
    with pytest.raises(ValueError, match=r"grads: pytree structure"):
        update({"w": jnp.ones((2, 2))}, state, params)
    state_of_other_params = tx.init({"w": jnp.ones((2, 2)), "b": jnp.ones((1, 3))})
    with pytest.raises(ValueError, match=r"state\['(momenta|mu)'\]\['b'\]: shape"):
        update(params, state_of_other_params, params)
    with pytest.raises(ValueError, match="state"):
        update(params, None, params)
    other_rule = LearnableAdamRule() if isinstance(rule, MLPUpdateRule) else SMALL_RULE
    with pytest.raises(ValueError, match="state: expected"):
        update(params, other_rule.init_state(params), params)
    with pytest.raises(ValueError, match=r"grads\['b'\]"):  # the bare rule checks too
        rule.update(rule.init_meta_params(jax.random.PRNGKey(0)), state, {"w": jnp.ones((2, 2)), "b": jnp.ones(4)},
                    params)


@pytest.mark.parametrize("rule", RULES, ids=RULE_IDS)
def test_empty_params_give_empty_updates_like_optax(rule):
    meta_params = rule.init_meta_params(jax.random.PRNGKey(0))
    tx = LearnedOptimizer(rule, meta_params).as_optax()
    updates, state = tx.update({}, tx.init({}), {})
    assert updates == {}
    updates, state = rule.update(meta_params, rule.init_state({}), {}, {})
    assert updates == {} and int(state["step"]) == 1


def test_one_non_finite_gradient_entry_poisons_only_its_tensor_as_documented():
    assert "NaN" in MLPUpdateRule.__doc__ and "tensor" in MLPUpdateRule.__doc__
    tx = LearnedOptimizer(SMALL_RULE, SMALL_RULE.init_meta_params(jax.random.PRNGKey(0))).as_optax()
    params = {"a": jnp.ones(4), "b": jnp.ones(4)}
    grads = {"a": jnp.asarray([1.0, jnp.nan, 1.0, 1.0]), "b": jnp.ones(4)}
    updates, _ = tx.update(grads, tx.init(params), params)
    assert bool(jnp.all(jnp.isnan(updates["a"]))) and bool(jnp.all(jnp.isfinite(updates["b"])))


def test_rule_configuration_errors_name_the_field():
    for bad, error in [(32, TypeError), ((2.7,), TypeError), ((0,), ValueError), ((True,), TypeError)]:
        with pytest.raises(error, match="hidden_sizes"):
            MLPUpdateRule(hidden_sizes=bad)
    for bad in (float("nan"), 0.0, -1e-3):
        with pytest.raises(ValueError, match="step_mult"):
            MLPUpdateRule(step_mult=bad)
    with pytest.raises(ValueError, match="exp_mult"):
        MLPUpdateRule(exp_mult=float("inf"))
    with pytest.raises(ValueError, match="initial_learning_rate"):
        MLPUpdateRule(initial_learning_rate=-1.0)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="initial_learning_rate"):
            LearnableAdamRule(bad)
    assert MLPUpdateRule(hidden_sizes=[np.int64(4)]).hidden_sizes == (4,)


def test_learned_optimizer_checks_meta_params_horizon_info_key_and_num_steps():
    rule = SMALL_RULE
    theta = rule.init_meta_params(jax.random.PRNGKey(0))
    with pytest.raises(TypeError, match=r"meta_params\['skip'\].*dtype"):
        LearnedOptimizer(rule, dict(theta, skip=theta["skip"].astype(jnp.int32)))
    with pytest.raises(TypeError, match="dtype"):
        LearnedOptimizer(rule, jax.tree.map(lambda x: np.asarray(x).astype(object), theta))
    with pytest.raises(ValueError, match=r"meta_params\['skip'\].*non-finite"):
        LearnedOptimizer(rule, dict(theta, skip=theta["skip"].at[0, 0].set(jnp.nan)))
    with pytest.raises(ValueError, match=r"meta_params\['layers'\]\[0\]\['b'\]: shape \(4,\)"):
        LearnedOptimizer(rule, MLPUpdateRule(hidden_sizes=(4,)).init_meta_params(jax.random.PRNGKey(0)))
    for bad, error in [(0, ValueError), (-5, ValueError), ("a", TypeError), (2.5, TypeError)]:
        with pytest.raises(error, match="train_horizon"):
            LearnedOptimizer(rule, theta, train_horizon=bad)
    with pytest.raises(TypeError, match="info"):
        LearnedOptimizer(rule, theta, info=5)
    with pytest.raises(TypeError, match="key"):
        LearnedOptimizer(rule).init(0)
    optimizer = LearnedOptimizer(rule, theta, train_horizon=np.int64(10))
    assert optimizer.train_horizon == 10 and type(optimizer.train_horizon) is int
    with pytest.raises(TypeError, match="num_steps"):
        optimizer.as_optax(num_steps=True)
    optimizer.as_optax(num_steps=np.int64(5))
    assert jax.tree.structure(optimizer.init(jax.random.key(1))) == jax.tree.structure(theta)
