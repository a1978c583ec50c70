"""One way to do each thing: where the scripts mean the same, their source is the same, byte for byte. Functions
and lines are taken from each script's source by name (ast), so a one-character drift in any copy fails here:

- dqn.py and double_dqn.py: everything but their target (``compute_td_target``) and the header lines;
- the quantile Huber loss in qrdqn.py, nc_qrdqn.py and iqn.py (the paper's, divided by kappa), and the fixed
  quantile fractions in qrdqn.py and nc_qrdqn.py;
- the categorical projection and the per-sample cross-entropy in c51.py and rainbow.py;
- the flags for running (RunFlags) are declared once, and every script's Args subclasses it;
- in every script: ``linear_schedule``, the start-or-restore lines, the --adam-eps check, the --fast lines with the Adam optimizer, and the
  update (the ``compute_loss`` call, the visible --on-nonfinite skip, ``zero_grad``, ``backward``, ``step``),
  which reads nothing back from the device unless --on-nonfinite skip asks.

algos/custom_value_atari.py, the template, runs dqn.py's loop: its loop and what follows it differ from dqn.py's only
where the algorithm is called (acting, the update, the target sync: TEMPLATE_LOOP_DIFFERENCES), and its shipped DQN
has dqn.py's --fast lines and --adam-eps check."""

from __future__ import annotations

import ast
import difflib
import re
import textwrap

import pytest
from conftest import REPO

SCRIPTS = ["dqn", "double_dqn", "c51", "qrdqn", "mdqn", "nc_qrdqn", "iqn", "rainbow", "drq"]
SAME_FUNCTIONS = {
    "quantile_huber_loss": ["qrdqn", "nc_qrdqn", "iqn"],
    "quantile_fractions": ["qrdqn", "nc_qrdqn"],
    "project_distribution": ["c51", "rainbow"],
    "per_sample_cross_entropy": ["c51", "rainbow"],
    "linear_schedule": [*SCRIPTS, "pqn"],
}
# PQN (algos/pqn.py) has no replay memory, target network or Adam: beside linear_schedule it shares these of
# SHARED_LINES (its signal message and checkpoint lines say "rollout" and hold no replay memory)
PQN_SHARED = ("--resume", "non-finite stop", "training done")


def sources() -> dict[str, str]:
    return {name: (REPO / "algos" / f"{name}.py").read_text() for name in [*SCRIPTS, "pqn"]}


def text(source: str, node: ast.AST) -> str:
    """a node's exact text in the source (ast.get_source_segment's result, without its slow line splitting)"""
    lines = source.splitlines(keepends=True)[node.lineno - 1 : node.end_lineno]
    if len(lines) == 1:
        return lines[0].encode()[node.col_offset : node.end_col_offset].decode()
    first, last = lines[0].encode()[node.col_offset :].decode(), lines[-1].encode()[: node.end_col_offset].decode()
    return first + "".join(lines[1:-1]) + last


def top_level(source: str) -> dict[str, str]:
    """each top-level function and class of a script, by name, as its exact text"""
    tree = ast.parse(source)
    return {node.name: text(source, node) for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def main_block(source: str) -> ast.If:
    tree = ast.parse(source)
    return next(node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test))


def segment(source: str, statements: list[ast.stmt]) -> str:
    return "\n".join(textwrap.dedent(text(source, s)) for s in statements)


def fast_lines(source: str) -> str:
    """from the channels-last ``if args.fast ...`` through ``optimizer = optim.Adam(...)``, as they stand"""
    body = main_block(source).body
    first = next(i for i, s in enumerate(body) if isinstance(s, ast.If) and "args.fast" in ast.unparse(s.test))
    last = next(i for i, s in enumerate(body) if isinstance(s, ast.Assign) and "optim.Adam(" in ast.unparse(s))
    return segment(source, body[first : last + 1])


def adam_eps_check(source: str) -> str:
    body = main_block(source).body
    [check] = [s for s in body if isinstance(s, ast.If) and "args.adam_eps" in ast.unparse(s.test)]
    return segment(source, [check])


def update_lines(source: str) -> tuple[str, str]:
    """(the ``compute_loss`` call, the lines after it through ``optimizer.step()``) in the learning block"""
    learning = next(
        node
        for node in ast.walk(main_block(source))
        if isinstance(node, ast.With) and ast.unparse(node.items[0].context_expr) == "run.timed('learning')"
    )
    steps = next(  # the statements around the compute_loss call (PQN's sit in its epoch and minibatch loops)
        node.body
        for node in ast.walk(learning)
        if isinstance(getattr(node, "body", None), list)
        and any(isinstance(s, ast.Assign) and "compute_loss(" in ast.unparse(s) for s in node.body)
    )
    first = next(i for i, s in enumerate(steps) if isinstance(s, ast.Assign) and "compute_loss(" in ast.unparse(s))
    last = next(i for i, s in enumerate(steps) if ast.unparse(s) == "optimizer.step()")
    return segment(source, steps[first : first + 1]), segment(source, steps[first + 1 : last + 1])


def restore_lines(source: str) -> str:
    """``learning_starts = args.learning_starts`` and the start-or-restore ``if`` after it"""
    body = main_block(source).body
    first = next(i for i, s in enumerate(body) if ast.unparse(s) == "learning_starts = args.learning_starts")
    return segment(source, body[first : first + 2])


def statements(source: str, first: str, count: int) -> str:
    """``count`` statements of the main block (at any depth), from the one whose text starts with ``first``"""
    for node in ast.walk(main_block(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for i, statement in enumerate(body):
                if ast.unparse(statement).startswith(first):  # as if at the left margin: PQN's loops nest
                    lines = [textwrap.dedent(" " * s.col_offset + text(source, s)) for s in body[i : i + count]]
                    return "\n".join(lines)
    raise AssertionError(f"no statement starting with {first!r}")


# what happens at a resume, a signal, a non-finite loss and a checkpoint: the same lines in every script
SHARED_LINES = {
    "--resume": ("try:\n    checkpoint = find_checkpoint(", 1),
    "signals": ("stop = StopFlag(", 3),
    "non-finite stop": ("values = run.train_metrics(", 3),
    "checkpoint": ("every = args.checkpoint_every", 3),
    "training done": ("stop.message = ", 2),
}


def drift(texts: dict[str, str]) -> list[str]:
    """the names whose text differs from the first one's"""
    (first, reference), *others = texts.items()
    return [f"{name} differs from {first}" for name, text in others if text != reference]


def all_drift(scripts: dict[str, str]) -> list[str]:
    """every drift this file checks, over the given scripts' sources"""
    found = []
    functions = {name: top_level(source) for name, source in scripts.items()}
    for function, names in SAME_FUNCTIONS.items():
        found += [f"{function}: {d}" for d in drift({name: functions[name][function] for name in names})]
    replay = {name: source for name, source in scripts.items() if name != "pqn"}
    found += [f"fast lines: {d}" for d in drift({name: fast_lines(s) for name, s in replay.items()})]
    found += [f"--adam-eps check: {d}" for d in drift({name: adam_eps_check(s) for name, s in replay.items()})]
    found += [f"update: {d}" for d in drift({name: update_lines(s)[1] for name, s in replay.items()})]
    found += [f"start or restore: {d}" for d in drift({name: restore_lines(s) for name, s in replay.items()})]
    for what, (first, count) in SHARED_LINES.items():
        sharing = scripts if what in PQN_SHARED else replay
        found += [f"{what}: {d}" for d in drift({name: statements(s, first, count) for name, s in sharing.items()})]
    dqn, double = functions["dqn"], functions["double_dqn"]
    found += [
        f"double_dqn.{name} differs from dqn's"
        for name in dqn
        if name != "compute_td_target" and dqn[name] != double.get(name)
    ]
    main = {name: text(scripts[name], main_block(scripts[name])) for name in ("dqn", "double_dqn")}
    found += [f"__main__ block: {d}" for d in drift(main)]
    return found


# ---------------------------------------------------------------- the checks


def test_the_scripts_share_their_common_parts_byte_for_byte():
    assert all_drift(sources()) == []


def test_dqn_and_double_dqn_have_the_same_functions():
    dqn, double = (top_level((REPO / "algos" / f"{n}.py").read_text()) for n in ("dqn", "double_dqn"))
    assert dqn.keys() == double.keys()
    assert dqn["compute_td_target"] != double["compute_td_target"]  # what Double DQN changes


def test_the_update_is_the_visible_cleanrl_update_without_a_host_read():
    """the loss function call, then zero_grad, backward, step, as CleanRL writes them; the only read of a device
    value is the --on-nonfinite skip test, and only when that flag asks (metrics are read every 1000 steps)"""
    for name, source in sources().items():
        call, rest = update_lines(source)
        if name == "pqn":  # a minibatch of the rollout, no target network; CleanRL's gradient clipping
            assert call == "loss, metrics = compute_loss(q_network, b_obs[batch], b_actions[batch], b_returns[batch])"
            clip = "nn.utils.clip_grad_norm_(q_network.parameters(), args.max_grad_norm)"
            assert rest.splitlines()[-4:] == ["optimizer.zero_grad()", "loss.backward()", clip, "optimizer.step()"]
        else:
            # drq: target_now, the online network itself while the target is synced after every update
            target = "target_now" if name == "drq" else "target_network"
            assert re.fullmatch(rf"loss, metrics(, \w+)? = compute_loss\(q_network, {target}, data, args\)", call)
            assert rest.splitlines()[-3:] == ["optimizer.zero_grad()", "loss.backward()", "optimizer.step()"], name
        assert 'if args.on_nonfinite == "skip" and not torch.isfinite(loss):' in rest, name
        without_guard = rest.replace('args.on_nonfinite == "skip" and not torch.isfinite(loss)', "")
        for read in (".item()", ".cpu()", "float(", "bool(", "isfinite", ".numpy()", ".tolist()"):
            assert read not in without_guard, f"{name}: {read} in the update"


def test_the_adam_line_carries_the_flag_and_every_script_has_it():
    for name, source in sources().items():
        if name == "pqn":  # CleanRL's PQN: RAdam at its default eps
            assert "optimizer = optim.RAdam(q_network.parameters(), lr=args.learning_rate)" in source
            continue
        assert "adam_eps: float = " in source, name
        assert "eps=args.adam_eps, fused=fused or None)" in fast_lines(source), name


@pytest.mark.parametrize(
    "script,original,changed",
    [
        ("iqn", "0.5 * u**2", "0.4 * u**2"),  # the quantile Huber loss in one of three
        ("qrdqn", "+ 0.5) / n", "+ 0.6) / n"),  # the fixed fractions
        ("rainbow", ".abs() / delta_z", ".abs() / delta_y"),  # the projection
        ("c51", "return -(target_probs", "return +(target_probs"),  # the cross-entropy
        ("mdqn", "eps=args.adam_eps, fused", "eps=args.adam_eps , fused"),  # the Adam line, a space
        ("nc_qrdqn", "optimizer.zero_grad()", "optimizer.zero_grad(set_to_none=False)"),  # the update
        ("double_dqn", "    slope = (end_e - start_e) / duration", "    slope = (end_e - start_e)/duration"),
        ("dqn", "gather(1, data.actions.unsqueeze(1))", "gather(1, data.actions.unsqueeze(-1))"),  # vs double
        ("rainbow", "must be > 0 and finite (this", "must be > 0 and finite  (this"),  # the --adam-eps check
        ("qrdqn", "learning_starts += global_step", "learning_starts = global_step"),  # the restore lines
        ("c51", "rb.cut_episodes()", "pass"),  # the restore lines
        ("iqn", "resume_args(args, checkpoint) if", "resume_args(args, checkpoint)  if"),  # --resume
        ("mdqn", "signal.signal(signal.SIGTERM, stop.set)", "signal.signal(signal.SIGHUP, stop.set)"),  # signals
        ("rainbow", 'if args.on_nonfinite == "stop" else {}', 'if args.on_nonfinite != "skip" else {}'),  # non-finite
        ("nc_qrdqn", "if stop.requested:\n", "if stop.requested and periodic:\n"),  # the checkpoint lines
        ("c51", "> previous_step // every and", ">= previous_step // every and"),  # the checkpoint lines
        ("qrdqn", "then the run ends as finished", "then the run ends"),  # training done
        ("pqn", "    slope = (end_e - start_e) / duration", "    slope = (end_e - start_e)/duration"),
        ("pqn", 'if args.on_nonfinite == "stop" else {}', 'if args.on_nonfinite != "skip" else {}'),  # non-finite
        ("pqn", "resume_args(args, checkpoint) if", "resume_args(args, checkpoint)  if"),  # --resume
        ("pqn", "no checkpoint is ", "no checkpoint  is "),  # training done
    ],
)
def test_a_one_character_change_in_one_copy_is_caught(script, original, changed):
    scripts = sources()
    assert scripts[script].count(original) >= 1, original
    assert all_drift(scripts) == []
    scripts[script] = scripts[script].replace(original, changed, 1)
    found = all_drift(scripts)
    assert found, f"{script}: {original!r} -> {changed!r} went unnoticed"


def test_the_flags_for_running_are_declared_once_and_every_script_has_them():
    """--torch-threads, --run-dir, the checkpoint flags, --resume and --buffer-device live in RunFlags only"""
    import dataclasses

    from cleanrl_utils.run_flags import RunFlags

    shared = {field.name for field in dataclasses.fields(RunFlags)}
    for path in sorted((REPO / "algos").glob("*.py")):
        tree = ast.parse(path.read_text())
        [args] = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Args"]
        assert [ast.unparse(base) for base in args.bases] == ["RunFlags"], path.name
        declared = {s.target.id for s in args.body if isinstance(s, ast.AnnAssign)}
        assert not declared & shared, f"{path.name} declares {sorted(declared & shared)} again"


def test_the_template_starts_and_restores_as_the_scripts_do():
    template = (REPO / "algos" / "custom_value_atari.py").read_text()
    assert restore_lines(template) == restore_lines(sources()["dqn"])
    assert "load_parts(parts, state)" in restore_lines(template)
    for what, (first, count) in SHARED_LINES.items():
        if what != "non-finite stop":  # the template has no --on-nonfinite: TEMPLATE_LOOP_DIFFERENCES
            assert statements(template, first, count) == statements(sources()["dqn"], first, count), what


# the only lines where the template's loop (and what follows it) differs from dqn.py's: the algorithm's calls
TEMPLATE_LOOP_DIFFERENCES = """
-            actions = rng.integers(0, envs.n_actions, args.num_envs)
-            greedy = rng.random(args.num_envs) >= epsilon
-            if greedy.any():
-                with torch.no_grad():
-                    q_values = q_network(torch.as_tensor(obs[greedy], device=device))
-                actions[greedy] = q_values.argmax(dim=1).cpu().numpy()
+            try:
+                actions = check_actions(algorithm.select_action(obs, epsilon), args.num_envs, envs.n_actions)
+            except TemplateRuleError as error:  # the receipt says failed: invalid actions
+                run.close(status=f"failed: {error.status}")
+                fail(str(error))
-                    loss, metrics = compute_loss(q_network, target_network, data, args)
-                    if args.on_nonfinite == "skip" and not torch.isfinite(loss):  # reads the loss: a host sync
-                        run.counts["skipped_updates"] += 1
-                        continue
-                    optimizer.zero_grad()
-                    loss.backward()
-                    optimizer.step()
+                    metrics = algorithm.update(data, global_step)
+                    try:
+                        metrics = check_metrics(metrics, global_step, sync=run.counts["gradient_updates"] == 0)
+                    except TemplateRuleError as error:  # e.g. failed: non-finite metrics
+                        run.close(status=f"failed: {error.status}")
+                        fail(str(error))
-                bad = nonfinite(values if args.on_nonfinite == "stop" else {}, q_network)
+                bad = nonfinite(values, q_network)
-                for target_param, q_param in zip(target_network.parameters(), q_network.parameters(), strict=True):
-                    target_param.data.copy_(args.tau * q_param.data + (1.0 - args.tau) * target_param.data)
+                algorithm.update_target_network(args.tau)
""".strip("\n").splitlines()


def loop_and_after(source: str) -> list[str]:
    """the main block from the training loop to its end, as lines"""
    body = main_block(source).body
    start = next(i for i, s in enumerate(body) if isinstance(s, ast.While))
    return segment(source, body[start:]).splitlines()


def template_loop_drift(template: str, dqn: str) -> list[str]:
    changed = [
        line
        for line in difflib.unified_diff(loop_and_after(dqn), loop_and_after(template), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    return [] if changed == TEMPLATE_LOOP_DIFFERENCES else changed


def template_fast_lines(template: str) -> str:
    """the shipped ValueAlgorithm's --fast lines through its Adam optimizer, without ``self.``, normalised"""
    [algorithm] = [n for n in ast.parse(template).body if isinstance(n, ast.ClassDef) and n.name == "ValueAlgorithm"]
    [init] = [n for n in algorithm.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    first = next(i for i, s in enumerate(init.body) if isinstance(s, ast.If) and "args.fast" in ast.unparse(s.test))
    last = next(i for i, s in enumerate(init.body) if isinstance(s, ast.Assign) and "optim.Adam(" in ast.unparse(s))
    return "\n".join(ast.unparse(s) for s in init.body[first : last + 1]).replace("self.", "")


def test_the_template_runs_dqns_loop_with_dqns_fast_lines_and_adam_check():
    template, dqn = (REPO / "algos" / "custom_value_atari.py").read_text(), sources()["dqn"]
    assert template_loop_drift(template, dqn) == []
    dqn_fast = "\n".join(ast.unparse(s) for s in ast.parse(fast_lines(dqn)).body)
    assert template_fast_lines(template) == dqn_fast
    assert adam_eps_check(template) == adam_eps_check(dqn)


@pytest.mark.parametrize(
    "in_dqn,original,changed",
    [
        (False, "update_credit -= args.train_frequency", "update_credit -= args.num_envs"),
        (False, "previous_step // args.target_network_frequency:", "previous_step // args.train_frequency:"),
        (True, "seed=args.seed + 10_000 + 100 *", "seed=args.seed + 10_000 + 10 *"),
        (False, "algorithm.update_target_network(args.tau)", "algorithm.update_target_network(1.0)"),
    ],
)
def test_a_change_in_the_template_loop_or_dqns_is_caught(in_dqn, original, changed):
    template, dqn = (REPO / "algos" / "custom_value_atari.py").read_text(), sources()["dqn"]
    if in_dqn:
        assert original in dqn
        dqn = dqn.replace(original, changed, 1)
    else:
        assert original in template
        template = template.replace(original, changed, 1)
    assert template_loop_drift(template, dqn), f"{original!r} -> {changed!r} went unnoticed"
