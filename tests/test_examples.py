"""Every script in examples/ runs as a user would run it, and prints what it claims.

Each example runs in a fresh subprocess (working directory a temporary folder, files
written there with `--out`), under a bounded timeout, without this suite's XLA/JAX
settings (the scripts choose their own devices), and with warnings as errors. Each
ends with a line `RESULT {json}` that the tests read; files they write are opened.
"""

import ast
import json
import os
import pathlib
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_batch as eb


pytestmark = pytest.mark.examples

ROOT = pathlib.Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"
# Generous: each script takes about 20 s on 2 idle CPU cores.
TIMEOUT = 300
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SCRIPTS = [
    "chees",
    "deep_scan",
    "ensemble_regression",
    "many_short_chains",
    "multi_process",
    "parallel_markov_chains",
    "pmap_outputs_to_list",
    "posteriors",
    "sbc",
    "vmap_affine",
]


def run_example(
    name: str, out: pathlib.Path, timeout: int = TIMEOUT, args: tuple[str, ...] = ()
) -> tuple[str, dict]:
    """Runs `examples/<name>.py --out OUT [ARGS]`; returns its output and its RESULT."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("XLA_", "JAX_"))
    }
    env.update(PYTHONWARNINGS="error", MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
    out.mkdir(parents=True, exist_ok=True)
    completed = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--out", str(out), *args],
        cwd=out,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, f"{name}.py failed:\n{output[-6000:]}"
    results = [
        line for line in completed.stdout.splitlines() if line.startswith("RESULT ")
    ]
    assert len(results) == 1, f"{name}.py printed no single RESULT line:\n{output}"
    assert completed.stdout.rstrip().endswith(results[0]), "RESULT is not the last line"
    return completed.stdout, json.loads(results[0].removeprefix("RESULT "))


def assert_png(path: pathlib.Path) -> tuple[int, int]:
    """A real PNG image that is not blank; returns its (height, width)."""
    # Imported here, so that `-m accelerator` collects this file on a machine
    # without matplotlib.
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC, f"{path} is not a PNG"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert np.ptp(image[..., :3]) > 0.5, f"{path} is blank"
    return image.shape[0], image.shape[1]


def test_every_example_is_tested_and_documented():
    assert sorted(p.stem for p in EXAMPLES.glob("*.py")) == SCRIPTS
    for name in SCRIPTS:
        source = (EXAMPLES / f"{name}.py").read_text()
        docstring = ast.get_docstring(ast.parse(source)) or ""
        assert f"python examples/{name}.py" in docstring, f"{name}: how to run it?"
        assert "RESULT" in docstring, f"{name}: the docstring should name its output"


def test_pmap_outputs_to_list(tmp_path):
    output, result = run_example("pmap_outputs_to_list", tmp_path)
    assert result["devices"] == 4
    assert result["num_tasks"] == 4
    assert result["index_matches_unstack"] is True
    assert result["round_trip_exact"] is True
    assert result["filter_pmap_tasks"] == 6
    assert result["filter_pmap_matches_single"] is True
    # Each task fitted its own line: the least-squares slope is near its true slope.
    np.testing.assert_allclose(result["slopes"], result["true_slopes"], atol=0.3)
    assert len(set(result["true_slopes"])) == 4

    per_task = json.loads((tmp_path / "per_task.json").read_text())
    assert isinstance(per_task, list) and len(per_task) == 4
    for task, slope in zip(per_task, result["slopes"], strict=True):
        assert sorted(task) == ["metrics", "params", "true_slope"]
        assert task["params"]["slope"] == pytest.approx(slope)
        assert len(task["metrics"]["worst_points"]) == 3
    assert "task 3: slope" in output


def test_parallel_markov_chains(tmp_path):
    output, result = run_example("parallel_markov_chains", tmp_path)
    chains = result["chains"]
    assert chains == 8 and result["draws"] == 200
    assert result["nonfinite_chains"] == []
    assert len(result["acceptance"]) == chains
    assert all(0.05 < rate < 0.8 for rate in result["acceptance"])
    # Every chain finds the posterior: its predictions sit near the truth and each
    # other's (a chain stuck elsewhere, or chains sharing a key, would show here).
    means = np.array(result["posterior_mean_at_query"])
    assert np.all(np.abs(means - result["truth_at_query"]) < 0.15)
    assert np.ptp(means) < 0.1 and len(set(means.tolist())) == chains
    assert result["rmse"] < 0.1
    assert_png(tmp_path / "chains_trace.png")
    assert "acceptance" in output and "posterior mean" in output

    # ArviZ's R-hat and ESS per recorded output, and its trace and rank plots.
    names = {"log_posterior", "prediction"}
    assert set(result["rhat"]) == set(result["ess"]) == names
    assert result["total_draws"] == chains * result["draws"]
    assert all(np.isfinite(r) and r > 0.99 for r in result["rhat"].values())
    assert all(0 < ess <= result["total_draws"] for ess in result["ess"].values())
    assert result["converged"] == (max(result["rhat"].values()) < 1.01)
    # The chains' mean log posteriors differ (the table above); R-hat sees it.
    assert result["rhat"]["log_posterior"] > 1.05 and not result["converged"]
    assert "worst R-hat" in output and "the chains have not mixed" in output
    assert result["arviz_pngs"] == [
        str(tmp_path / "chains_arviz_trace.png"),
        str(tmp_path / "chains_arviz_rank.png"),
    ]
    for png in result["arviz_pngs"]:
        assert_png(pathlib.Path(png))


def test_vmap_affine(tmp_path):
    output, result = run_example("vmap_affine", tmp_path)
    for flag in (
        "raw_error",
        "shared_matches_loop",
        "per_example_matches_loop",
        "batch_error_names_argument",
        "batch_error_suggests_fix",
        "typecheck_count_error",
        "typecheck_unstacked_error",
    ):
        assert result[flag] is True, flag
    assert result["accuracy"] > 0.9
    assert all(accuracy > 0.9 for accuracy in result["member_accuracy"])
    # The errors are shown to the reader, not only checked.
    assert "dot_general requires contracting dimensions" in output
    assert "did you mean in_axes=(0, None, None)?" in output
    assert "TypeCheckError" in output


def test_ensemble_regression(tmp_path):
    _, result = run_example("ensemble_regression", tmp_path)
    members = result["members"]
    member_mse = np.array(result["member_mse"])
    assert members == 8 and member_mse.shape == (members,)
    assert np.all(np.isfinite(member_mse)) and np.all(member_mse < 0.5)
    # The point of an ensemble: its mean beats a typical member.
    assert result["ensemble_mse"] < result["median_member_mse"]
    assert result["median_member_mse"] == pytest.approx(np.median(member_mse))
    assert result["best_member_mse"] == pytest.approx(member_mse.min())
    # The edited member is the worst one, and editing it left the others alone.
    assert result["edited_member"] == int(np.argmax(member_mse))
    assert result["edited_member_mse"][0] == pytest.approx(member_mse.max())
    assert result["others_unchanged"] is True
    assert result["load_stacked_ok"] is True
    assert result["load_list_ok"] is True
    assert result["restack_loaded_list_ok"] is True

    size = assert_png(tmp_path / "ensemble_regression.png")
    # The README shows a committed copy of this plot.
    assert assert_png(ROOT / "docs" / "assets" / "ensemble_regression.png") == size

    # The checkpoints are real eqx_batch files that load here, stacked or as a list.
    like = eqx.filter_eval_shape(
        eb.ensemble,
        eqx.nn.MLP,
        members,
        in_size="scalar",
        out_size="scalar",
        width_size=32,
        depth=2,
        activation=jnp.tanh,
        key=jax.random.key(0),
    )
    stacked = eb.load(tmp_path / "ensemble.eqx", like=like)
    as_list = eb.load(tmp_path / "members.eqx", like=eb.unstack(stacked))
    assert eb.batch_size(stacked) == members and len(as_list) == members
    for i, member in enumerate(as_list):
        for a, b in zip(
            jax.tree.leaves(eqx.filter(member, eqx.is_array)),
            jax.tree.leaves(eqx.filter(eb.index(stacked, i), eqx.is_array)),
            strict=True,
        ):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_deep_scan(tmp_path):
    output, result = run_example("deep_scan", tmp_path)
    assert result["depth"] == 64
    assert result["output_shape"] == [256, 64]
    assert result["outputs_finite"] is True
    assert result["max_output_difference"] <= 1e-5
    assert result["max_gradient"] > 0
    assert result["max_gradient_difference"] <= 1e-5 * max(1.0, result["max_gradient"])
    for kind in ("scan", "unrolled"):
        assert result["compile_seconds"][kind] > 0
        assert result["run_seconds"][kind] > 0
    assert "eb.scan_layers" in output and "Python loop" in output


def test_multi_process(tmp_path):
    output, result = run_example("multi_process", tmp_path)
    assert result["process_exit_codes"] == [0, 0]
    # The job's chains are those of one process with 4 devices, bit for bit.
    assert result["bit_for_bit"] is True
    assert output.count(f"checksum {result['checksum']}") == 2
    # Both processes joined one job of 4 devices; process 0 reported the chains.
    assert output.count("joined: 4 devices in the job, 2 of them here") == 2
    assert "[process 0] checksum" in output and "[process 1] checksum" not in output
    assert "in this ONE process, on 4 devices" in output
    # The commands a user would run by hand, one per process.
    assert "--process-id 0" in output and "--process-id 1" in output

    # The run of parallel_markov_chains.py: its state, outputs and keys, per chain.
    with np.load(tmp_path / "multi_process.npz") as saved:
        job = dict(saved)
    assert {name: value.shape for name, value in job.items()} == {
        "final.layer1.weights": (8, 5, 2),
        "final.layer2.weights": (8, 1, 6),
        "outputs.accepted": (8, 200),
        "outputs.log_posterior": (8, 200),
        "outputs.prediction": (8, 200, 41),
        "keys": (8, 2),
    }
    assert result["chains"] == 8 and result["draws"] == 200
    acceptance = job["outputs.accepted"].mean(axis=1)
    np.testing.assert_array_equal(result["acceptance"], acceptance)
    # The chains moved, and differ from each other.
    assert np.all((acceptance > 0.05) & (acceptance < 0.8))
    assert len(np.unique(job["final.layer2.weights"][:, 0, 0])) == 8


def test_many_short_chains(tmp_path):
    # It compiles four HMC loops over 1024 chains: about 1.5 min of CPU time, and
    # more than TIMEOUT of wall time on a 2-core machine other jobs share.
    output, result = run_example("many_short_chains", tmp_path, timeout=2 * TIMEOUT)
    threshold = np.sqrt(1 + 1 / 64 + 1e-4)  # the paper's, for M = 64
    assert set(result["targets"]) == {"eight schools", "100-d Gaussian"}
    for name, target in result["targets"].items():
        assert target["chains"] >= 1024 and target["budget"] == 2000
        # It stopped at the first check nested R-hat passed, before the budget.
        assert target["converged"] is True, name
        assert target["steps_done"] == target["checks"][-1] < target["budget"]
        assert target["checks"] == list(range(50, target["steps_done"] + 1, 50))
        assert target["worst"][-1] <= threshold
        assert all(worst > threshold for worst in target["worst"][:-1])
        assert target["window_start"] == target["steps_done"] - 50
        # ArviZ, on the stored draws of the passing window, computes what the run
        # computed on the devices (float32 draws).
        assert target["arviz_nested_rhat"] == pytest.approx(target["worst"][-1], 1e-4)
        assert target["fixed_nested_rhat"] <= threshold
        assert target["fresh_nested_rhat"] < 1.05
        # Stopped or not, the answer is near the known one: means within a fifth of
        # a posterior sd, variances within 20%.
        for run in ("window", "short", "fresh", "budget"):
            assert target["errors"][run]["mean"] < 0.2, (name, run)
            assert target["errors"][run]["var"] < 0.2, (name, run)
        assert 0.5 < target["acceptance"] < 1.0
        assert target["summary_rows"] == {"eight schools": 4, "100-d Gaussian": 3}[name]
    # The Gaussian's widest coordinate takes longer to cross than eight schools.
    gaussian, schools = (
        result["targets"][n] for n in ("100-d Gaussian", "eight schools")
    )
    assert gaussian["steps_done"] > schools["steps_done"]
    # ArviZ's summary of the draws after the stop, and the table of errors.
    assert "ess_bulk" in output and "mcse_mean" in output
    assert "mean error (sd)" in output and "fixed budget (steps 1001-2000)" in output

    size = assert_png(tmp_path / "many_short_chains.png")
    # docs/many_short_chains.md shows a committed copy of this plot.
    assert assert_png(ROOT / "docs" / "assets" / "many_short_chains.png") == size


def test_posteriors(tmp_path):
    # A module of models (issue 44) that benchmarks and tests import; run, it
    # prints a table of them.
    output, result = run_example("posteriors", tmp_path)
    models = result["models"]
    assert {name: row["dimension"] for name, row in models.items()} == {
        "eight schools, centred": 10,
        "eight schools, non-centred": 10,
        "funnel": 10,
        "ill-conditioned Gaussian": 100,
        "logistic regression": 25,
        "hierarchical logistic regression": 28,
        "banana": 2,
    }
    for name, row in models.items():
        # Vmapped over 4 problems of 16 chains each, from the model's starts.
        assert row["log_density_shape"] == [4, 16], name
        assert row["finite"] is True, name
        assert np.isfinite(row["median_log_density"]), name
        exact = row["exact_sampler"]
        assert exact == (row["data"] == {"unused": []}), name
        assert row["moments"] == (
            "closed form" if exact else None if "logistic" in name else "quadrature"
        ), name
        if exact:
            # 100000 exact draws have the stated moments, within Monte-Carlo error
            # (the funnel's x have a kurtosis of 3 e^9: their variance's standard
            # error, estimated from the draws, is itself rough; this run: 4.1).
            assert row["exact_mean_error_se"] < 5, name
            assert row["exact_variance_error_se"] < (10 if name == "funnel" else 5)
    assert models["eight schools, centred"]["data"] == {"sigma": [8], "y": [8]}
    assert models["logistic regression"]["data"] == {"x": [100, 25], "y": [100]}
    assert models["hierarchical logistic regression"]["data"] == {
        "x": [8, 20, 3],
        "y": [8, 20],
    }
    assert "hierarchical logistic regression" in output and "quadrature" in output
    assert list(tmp_path.iterdir()) == []  # it writes nothing


def test_sbc(tmp_path):
    # 64 replications, not the page's 1000: the same compiled loop, within TIMEOUT.
    output, result = run_example("sbc", tmp_path, args=("--replications", "64"))
    replications = result["replications"]
    assert replications == 64 and result["chains_per_replication"] == 16
    assert result["draws"] == 224
    quantities = ["mu", "tau"] + [
        f"{name}[{j}]" for name in ("theta", "theta_tilde") for j in range(8)
    ]
    assert sorted(result["uniformity"]) == sorted(quantities)
    # Every replication's ranks are counted once, in bins that divide 0..224 evenly.
    assert 225 % result["bins"] == 0
    for name in quantities:
        assert sum(result["histograms"][name]) == replications
    # The sampler mixed, in every replication: R-hat per problem from the run.
    assert 0.6 < result["acceptance"]["min"] <= result["acceptance"]["mean"] < 1.0
    assert result["nested_rhat"]["max"] < 1.02
    assert result["rhat"]["max"] < 1.05
    # Calibration: no quantity's ranks are far from uniform (the smallest p-value of
    # this run is 0.02). A sampler whose likelihood halves sigma, its step size
    # halved so that it still mixes, fails here: the data then look too spread for
    # their noise, tau's posterior sits above the truth, and its ranks pile at the
    # bottom ([51, 9, 4] in 3 bins; p = 3e-14 and 2e-16), 3 bins outside the band.
    assert result["min_ks_p"] > 1e-3 and result["min_chi2_p"] > 1e-3
    for test in result["uniformity"].values():
        assert test["outside_band"] <= 1
    assert "bins outside the 99% band" in output
    size = assert_png(tmp_path / "sbc_ranks.png")
    # docs/sbc.md shows a committed copy of this plot, of 1000 replications: other
    # bins and counts, whose tick labels move its tight bounding box by a pixel or two.
    assert _about(assert_png(ROOT / "docs" / "assets" / "sbc_ranks.png"), size)

    # The same replications with a warmup that stops per replication, each on its
    # own superchains, at a check (every 50 steps) and at or before the cap.
    stopping = result["stopping"]
    steps_done = np.array(stopping["steps_done"])
    assert steps_done.shape == (replications,)
    assert np.all((steps_done > 0) & (steps_done <= result["num_steps"]))
    assert np.all(steps_done % stopping["check_every"] == 0)
    # The window that passed is the last one, of one interval, before each stop.
    assert stopping["window_start"] == (steps_done - stopping["check_every"]).tolist()
    # With the half-normal prior every replication converges, most well before the
    # fixed budget's 300 steps of warmup (this run: 30 of 64 at the first check), so
    # warmup + fresh sample costs fewer chain-steps than the fixed budget.
    assert stopping["converged"] == replications
    assert np.median(steps_done) < 300
    chain_steps = stopping["chain_steps"]
    assert chain_steps["stopping + fresh sample"] == 16 * (
        steps_done.sum() + stopping["sample_steps"] * replications
    )
    assert chain_steps["stopping + fresh sample"] < chain_steps["fixed budget"]
    # The fresh sample, continuing each chain exactly, mixes and is calibrated by the
    # same bounds as the fixed budget (this run's smallest p-value: 0.02). A fresh
    # sample whose likelihood halves sigma fails here: with the step size it diverges
    # (lowest acceptance 0.004); with a quarter of it, it mixes too slowly (R-hat
    # 1.18) and tau's ranks are far from uniform (p = 8e-15, 3 bins outside).
    assert 0.6 < stopping["fresh_mixing"]["acceptance"]["min"]
    assert stopping["fresh_mixing"]["rhat"]["max"] < 1.05
    assert set(stopping["uniformity"]) == {
        "fresh sample",
        "stopped window",
        "fresh first window",
    }
    for tests in stopping["uniformity"].values():
        assert sorted(tests) == sorted(quantities)
    assert stopping["min_p"]["fresh sample"] > 1e-3
    for test in stopping["uniformity"]["fresh sample"].values():
        assert test["outside_band"] <= 1
    assert "replications stopping at each check" in output
    # The spread of the stopped window's draws over its control's, per quantity: a
    # ratio of positive standard deviations.
    assert sorted(stopping["spread_ratio"]) == sorted(quantities)
    assert all(0.0 < ratio < np.inf for ratio in stopping["spread_ratio"].values())
    size = assert_png(tmp_path / "sbc_stopping.png")
    assert _about(assert_png(ROOT / "docs" / "assets" / "sbc_stopping.png"), size)


def _about(size: tuple[int, int], other: tuple[int, int]) -> bool:
    """Whether two plots' (height, width) agree to 2%."""
    return all(abs(a - b) <= 0.02 * b for a, b in zip(size, other, strict=True))
