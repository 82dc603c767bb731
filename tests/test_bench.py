"""The benchmark plumbing on the CPU: dry runs of the grid scripts and of bench/run_all.sh (fake
timings), the developer tools in bench/tools/, and the flash-attn-4 staging script's failure paths.
The measurements themselves need the GPU machine (bench/run_all.sh)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
TOOLS = os.path.join(BENCH, "tools")


def _run(args, env=None, **kwargs):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, BENCH]), **(env or {}))
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, **kwargs)


def _tool_result(tmp_path, script, *args, result="") -> dict:
    """Run bench/<script> (tools/<name> for a tool) with `args` and --out tmp_path; assert it succeeded;
    its <result>.json."""
    done = _run([sys.executable, f"bench/{script}", *args, "--out", str(tmp_path)])
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / f"{result}.json") as handle:
        return json.load(handle)


def _dry_grid(tmp_path, *extra):
    done = _run([sys.executable, "bench/bench_attention.py", "--dry-run", "--backward", "--seqlens", "64,128",
                 "--head-dims", "64", "--impls", "portattn,sdpa_cudnn,fa4", "--out", str(tmp_path), *extra],
                env={"PORTATTN_FA4_MISSING": "wheels not stashed"})
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "hopper_bench.json") as handle:
        return done.stdout, json.load(handle)


def test_dry_run_fills_every_cell_or_says_why(tmp_path):
    stdout, result = _dry_grid(tmp_path)
    assert result["dry_run"] and "DRY RUN" in result["device"]
    assert [(r["seqlen"], r["causal"]) for r in result["grid"]] == [(64, False), (64, True), (128, False), (128, True)]
    for row in result["grid"]:
        for mode in ("fwd", "fwd_bwd"):
            assert row["backend"][mode] == "reference"  # CPU tensors: dispatch's only choice
            assert row["tflops"][mode]["portattn"] > 0
            for name in ("sdpa_cudnn", "fa4"):  # no cuDNN, no flash-attn-4 on this CPU
                assert row["tflops"][mode][name] is None
                assert row["na"][mode][name]
            assert "wheels not stashed" in row["na"][mode]["fa4"]
    markdown = (tmp_path / "hopper_bench.md").read_text()
    assert "## Forward TFLOP/s" in markdown and "## Forward+backward TFLOP/s" in markdown
    assert "portattn / SDPA cuDNN" in markdown and "flash-attn-4: ImportError: wheels not stashed" in markdown
    assert (tmp_path / "hopper_bench.png").stat().st_size > 0
    assert "portattn dispatch chose: fwd: reference; fwd_bwd: reference" in stdout


def test_dry_run_past_its_budget_writes_na_cells(tmp_path):
    _, result = _dry_grid(tmp_path, "--budget-s", "0")
    cells = [why for row in result["grid"] for per_mode in row["na"].values() for why in per_mode.values()]
    assert len(cells) == 4 * 2 * 3 and all("time budget" in why for why in cells)


def test_determinism_dry_run_reports_the_ratio(tmp_path):
    done = _run([sys.executable, "bench/bench_backward.py", "--dry-run", "--determinism", "--seqlens", "4096",
                 "--out", str(tmp_path)])
    assert done.returncode == 0, done.stderr[-3000:]
    section = (tmp_path / "determinism.md").read_text().split("## Deterministic backward")[1]
    lines = [line for line in section.splitlines() if line.startswith("| 128 | 4096 |")]
    assert len(lines) == 2  # causal and not
    for line in lines:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        default, det, ratio = float(cells[4]), float(cells[5]), float(cells[6])
        assert ratio == pytest.approx(det / default, abs=0.02)


def test_short_sequence_dry_run_uses_its_own_batch_and_heads(tmp_path):
    result = _tool_result(tmp_path, "bench_short.py", "--dry-run", "--seqlens", "50,64", "--head-dims", "16",
                          "--impls", "portattn,sdpa_cudnn", result="short_seq")
    assert [(r["head_dim"], r["seqlen"], r["causal"]) for r in result["grid"]] == [
        (16, 50, False), (16, 50, True), (16, 64, False), (16, 64, True)]
    assert {(r["batch"], r["heads"]) for r in result["grid"]} == {(512, 16)}
    assert all(r["tflops"]["fwd"]["portattn"] > 0 for r in result["grid"])
    assert "batch 512, 16 heads" in (tmp_path / "short_seq.md").read_text()


def test_varlen_dry_run_writes_every_scenario(tmp_path):
    result = _tool_result(tmp_path, "bench_varlen.py", "--dry-run", "--head-dims", "64", result="varlen")
    assert [(r["scenario"], r["causal"]) for r in result["rows"]] == [
        (name, causal) for name in ("equal 16x1k", "equal 4x4k", "mixed 64-4096", "short 32-300")
        for causal in (False, True)]
    assert all(r["tflops"][mode]["portattn"] > 0 for r in result["rows"] for mode in ("fwd", "fwd_bwd"))
    sys.path.insert(0, BENCH)
    import bench_varlen

    lengths = bench_varlen.mixed_lengths()
    assert sum(lengths) == bench_varlen.TOKENS and min(lengths) >= 64 and max(lengths) <= 4096
    assert len(set(lengths)) > 3, "the mixed scenario should mix lengths"
    short = bench_varlen.scenarios(False)[bench_varlen.SHORT]
    assert sum(short) == bench_varlen.SHORT_TOKENS and min(short) >= 32 and max(short) <= 300
    assert list(bench_varlen.scenarios(False, "short")) == [bench_varlen.SHORT]


def test_sass_opcode_counts_skip_predicates_and_split_kernels():
    sys.path.insert(0, TOOLS)
    import sass_stats

    text = """
        Function : _Z3fooPf
        /*0000*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;   /* 0x000 */
        /*0010*/              @!P0 HMMA.16816.F32.BF16 R4, R8, R12, R4 ;       /* 0x000 */
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;       /* 0x000 */
        Function : _Z3barPf
        /*0000*/               @P1 LDSM.16.M88.4 R4, [R2] ;                   /* 0x000 */
        /*0010*/                   EXIT ;                                       /* 0x000 */
    """
    counts = sass_stats.parse(text)
    assert counts["_Z3fooPf"] == {"IMAD": 1, "HMMA": 2}
    assert counts["_Z3barPf"] == {"LDSM": 1, "EXIT": 1}


def test_tile_balance_model_pairs_equal_cost_tiles():
    # bench/tools/tile_balance.py mirrors the Hopper forward's walks (Note [portattn hopper paired
    # tiles]); balance() itself asserts that the paired order visits every tile once.
    sys.path.insert(0, TOOLS)
    import tile_balance

    for num_m_blocks in (1, 4, 5, 8):
        for heads_batches in (1, 2, 3, 7):
            tiles = [tile_balance.paired_order(t, num_m_blocks) for t in range(num_m_blocks * heads_batches)]
            assert sorted(tiles) == [(hb, m) for hb in range(heads_batches) for m in range(num_m_blocks)]
            # Positions 2q, 2q + 1: query blocks summing to num_m_blocks - 1 (one long, one short, or two
            # middle blocks of neighbouring heads), so every pair costs the same under causal masking.
            for q in range(len(tiles) // 2):
                assert tiles[2 * q][1] + tiles[2 * q + 1][1] == num_m_blocks - 1
    row = tile_balance.balance(512, 64, sms=132, overhead=1.0)
    assert row["tiles"] == 4096 and row["paired"] < row["group"]
    # 2048 equal pairs over 132 CTAs: the slowest walks 16 of them, the mean 2048 / 132.
    assert row["paired"] == pytest.approx(16 * 132 / 2048)


def test_ncu_opcode_mix_weighs_instructions_by_executions(tmp_path):
    sys.path.insert(0, TOOLS)
    import ncu_opcode_mix

    page = tmp_path / "src.csv"
    page.write_text('"Kernel Name","k"\n'
                    '"Address","Source","Instructions Executed"\n'
                    '"0x0","      FFMA R1, R2, R3, R4","100"\n'
                    '"0x10","@!P0  BRA 0x40","7"\n'
                    '"0x20","      FFMA.FTZ R1, R2, R3, R4","5"\n'
                    '"0x30","@P1   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R1], R2","3"\n')
    counts, total = ncu_opcode_mix.opcode_mix(str(page))
    assert counts == {"FFMA": 105, "BRA": 7, "SYNCS": 3} and total == 115
    done = _run([sys.executable, "bench/tools/ncu_opcode_mix.py", str(page), str(page), "--per=5"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ratio 1.000" in done.stdout and "FFMA" in done.stdout and "21.0" in done.stdout  # 105 / 5


def test_ncu_sass_stalls_sums_a_reason_by_opcode(tmp_path, capsys):
    sys.path.insert(0, TOOLS)
    import ncu_sass_stalls

    page = tmp_path / "src.csv"
    page.write_text('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
                    '"stall_wait","stall_barrier","stall_wait (Not Issued)"\n'
                    '"0x0","      MUFU.EX2 R1, R2","10","64","7","3","99"\n'
                    '"0x10","@!P0  MUFU.EX2 R3, R4","4","64","4","0","99"\n'
                    '"0x20","      F2FP.BF16.F32.PACK_AB R5, R1, R3","6","32","1","5","99"\n')
    assert ncu_sass_stalls.opcode("@!P0  MUFU.EX2 R3, R4") == "MUFU"
    assert ncu_sass_stalls.main(["ncu_sass_stalls.py", str(page), "--by-opcode"]) == 0
    text = capsys.readouterr().out
    # 12 of 20 samples are "wait" (the "Not Issued" column is not a reason); 11 of them on the MUFUs.
    assert "'wait' 60.0% of them" in text and "MUFU 55.0%" in text and "F2FP 5.0%" in text
    assert "executed by opcode: MUFU 128, F2FP 32" in text


def test_ncu_summary_reads_the_raw_page(tmp_path):
    sys.path.insert(0, TOOLS)
    import ncu_profile

    raw = tmp_path / "raw.csv"
    raw.write_text(
        '"ID","Kernel Name","gpu__time_duration.sum","launch__registers_per_thread",'
        '"smsp__average_warp_latency_issue_stalled_barrier.ratio","smsp__average_warp_latency_issue_stalled_gmma.ratio"\n'
        '"","","msecond","register/thread","",""\n'
        '"0","hopper_fwd_kernel","4.0","168","1.5","9.25"\n')
    text = ncu_profile.summarize(str(raw), "fwd", ncu_profile.case_flops("fwd"))
    assert "registers / thread" in text and "168" in text
    assert "gmma 9.25, barrier 1.50" in text  # largest stall first
    assert f"{ncu_profile.case_flops('fwd') / 4.0e-3 / 1e12:.0f}" in text
    raw.write_text('"ID","Kernel Name"\n"",""\n')
    assert "profiled no kernel" in ncu_profile.summarize(str(raw), "fwd", 1.0)


def test_fa4_stage_says_what_is_missing(tmp_path):
    parts, site = tmp_path / "parts", tmp_path / "site"
    env = {"FA4_PARTS": str(parts), "FA4_SITE": str(site)}
    done = _run(["bash", "bench/tools/fa4_stage.sh", "install"], env=env)
    assert done.returncode == 1 and done.stdout.startswith("export PORTATTN_FA4_MISSING=")
    half = tmp_path / "a"
    half.mkdir()
    (half / "nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl.part00").write_bytes(b"PK")
    assert _run(["bash", "bench/tools/fa4_stage.sh", "stash", str(half)], env=env).returncode == 0
    done = _run(["bash", "bench/tools/fa4_stage.sh", "install"], env=env)
    assert done.returncode == 1 and "only\\ one\\ half" in done.stdout
    # What install prints must be eval-able by the caller's shell, the reason intact.
    shown = _run(["bash", "-c", f'eval "{done.stdout.strip()}"; echo "$PORTATTN_FA4_MISSING"'])
    assert shown.stdout.startswith("only one half of nvidia_cutlass_dsl_libs_cu13")


@pytest.mark.parametrize("script", ["tools/fa4_stage.sh", "tools/ncu_stage.sh", "run_all.sh", "conformance/run.sh"])
def test_stage_scripts_parse(script):
    done = _run(["bash", "-n", os.path.join("bench", script)])
    assert done.returncode == 0, done.stderr


def test_ring_proxy_dry_run_writes_json_and_markdown(tmp_path):
    result = _tool_result(tmp_path, "tools/bench_ring_proxy.py", "--dry-run", "--ranks", "2,4", result="ring_proxy")
    assert result["dry_run"] and result["device"] == "cpu"
    assert {(r["ranks"], r["backward"]) for r in result["rows"]} == {(2, False), (4, False), (2, True), (4, True)}
    for row in result["rows"]:
        assert row["steps"] == row["ranks"] ** 2 and row["whole_ms"] > 0 and row["ring_ms"] > 0
    table = (tmp_path / "ring_proxy.md").read_text()
    assert "overhead / step" in table and table.count("\n| 64 |") == 4


def _markdown_files():
    yield os.path.join(ROOT, "README.md")
    for folder in ("docs", os.path.join("bench", "results")):
        for dirpath, _, names in os.walk(os.path.join(ROOT, folder)):
            yield from (os.path.join(dirpath, n) for n in names if n.endswith(".md"))


def test_result_and_doc_links_resolve():
    """Every relative markdown link in README, docs/ and bench/results/ names an existing file,
    and every `bench/results/...` or `docs/...` path cited in the code exists."""
    import re

    broken = []
    for path in _markdown_files():
        text = open(path).read()
        for target in re.findall(r"\]\(([^)#\s]+)\)", text):
            if "://" not in target and not os.path.exists(os.path.join(os.path.dirname(path), target)):
                broken.append(f"{os.path.relpath(path, ROOT)}: {target}")
    cited = subprocess.run(["git", "grep", "-ohE", r"(bench/results|docs)/[A-Za-z0-9_./-]+\.(md|json|png|txt|log)"],
                           cwd=ROOT, capture_output=True, text=True).stdout.split()
    broken += [c for c in set(cited) if "*" not in c and "<" not in c and not os.path.exists(os.path.join(ROOT, c))]
    assert not broken, broken


def test_process_variance_probe_dry_run_reports_every_process(tmp_path):
    result = _tool_result(tmp_path, "tools/probe_process_variance.py", "--dry-run", "--short", "16:50:causal",
                          "--processes", "2", result="process_variance")
    assert result["cell"] == "short 16:50:causal, portattn" and len(result["processes"]) == 2
    for row in result["processes"]:
        assert "error" not in row, row
        assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0 and set(row["ptr_mod_2mib"]) == {"q", "k", "v", "dout"}
        assert row["impl"] == "portattn"
    table = (tmp_path / "process_variance.md").read_text()
    assert table.count("\n| 0 | portattn |") == 1 and table.count("\n| 1 | portattn |") == 1
    assert "portattn forward+backward: slowest / fastest process" in table


def test_profile_host_dry_run_reports_issue_times_and_profiles(tmp_path):
    result = _tool_result(tmp_path, "tools/profile_host.py", "--dry-run", "--short", "16:50:causal", "--steps", "20",
                          "--impls", "portattn", result="host_profile")
    times = result["impls"]["portattn"]
    assert times["forward_us"] > 0 and times["backward_us"] > 0
    assert times["step_us"] >= max(times["forward_us"], times["backward_us"])
    assert "run_backward" in times["profile"]["cumulative"]  # the profile saw our backward
    table = (tmp_path / "host_profile.md").read_text()
    assert "\n| portattn | " in table and "cProfile" in table


def test_host_overhead_cpu_times_every_shape_on_the_compiled_path(tmp_path):
    out = tmp_path / "host_overhead.json"
    done = _run([sys.executable, "bench/tools/host_overhead_cpu.py", "--repeat", "2", "--calls", "5", "--out", str(out),
                 "--profile", "short"])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["shapes"]) == {"short", "hd128_1k", "varlen", "gqa", "floor"}
    for name, row in result["shapes"].items():
        assert row["forward_us"] > 0 and row["backward_us"] > 0, (name, row)
        assert row["step_us"] >= max(row["forward_us"], row["backward_us"]), (name, row)
        assert row["steps"] == 10
    # Dispatch chose as on an H100: hd16 on the sm80+ kernels, the rest on the Hopper path
    # (the tool itself fails if any step fell back to the reference backend).
    assert result["shapes"]["short"]["entry_points"] == ["bwd", "fwd"]
    assert result["shapes"]["gqa"]["entry_points"] == ["hopper_bwd", "hopper_fwd"]
    assert "\n| short | bwd/fwd | " in done.stdout
    assert "run_forward" in done.stdout and "us per step" in done.stdout  # the profile


def test_ab_table_rounds_and_ratios(tmp_path):
    sys.path.insert(0, TOOLS)
    try:
        import ab_table
    finally:
        sys.path.pop(0)

    def write(name, tflops):
        folder = tmp_path / name
        folder.mkdir()
        grid = [{"head_dim": 64, "seqlen": 512, "causal": True, "tflops": {"fwd": tflops}}]
        (folder / "x.json").write_text(json.dumps({"grid": grid}))

    write("grid_A_r1", {"portattn": 100.0, "portattn_sm80": 50.0})
    write("grid_A_r2", {"portattn": 110.0, "portattn_sm80": 50.0})
    write("grid_B_r1", {"portattn": 126.0, "sdpa_cudnn": 120.0, "portattn_sm80": 60.0, "sdpa_flash": 40.0})
    write("grid_B_r2", {"portattn": 126.0, "portattn_sm80": 40.0})
    text = ab_table.table(str(tmp_path), "grid", "A", "B", 2, "sdpa_cudnn")
    assert "| 64 | 512 | causal | 100.0 110.0 | 126.0 126.0 | 1.200 | 1.050 |" in text
    # Another column (the sm80+ path), against another peer.
    text = ab_table.table(str(tmp_path), "grid", "A", "B", 2, "sdpa_flash", impl="portattn_sm80")
    assert "| 64 | 512 | causal | 50.0 50.0 | 60.0 40.0 | 1.000 | 1.250 |" in text


def test_grid_in_several_processes_reports_medians_and_spread(tmp_path):
    _, result = _dry_grid(tmp_path, "--processes", "2")
    assert result["processes"] == 2 and "median of 2 fresh processes" in result["note"]
    assert [(r["seqlen"], r["causal"]) for r in result["grid"]] == [(64, False), (64, True), (128, False), (128, True)]
    for row in result["grid"]:
        for mode in ("fwd", "fwd_bwd"):
            low, high = row["spread"][mode]["portattn"]
            assert 0 < low <= row["tflops"][mode]["portattn"] <= high
            assert "sdpa_cudnn" not in row["spread"][mode]  # measured by no process on this CPU
    assert "## Spread across processes" in (tmp_path / "hopper_bench.md").read_text()


def test_merge_processes_takes_each_cells_median():
    sys.path.insert(0, BENCH)
    try:
        import bench_attention
    finally:
        sys.path.pop(0)

    def run(value):
        return {"grid": [{"head_dim": 64, "seqlen": 512, "causal": True,
                          "tflops": {"fwd": {"portattn": value, "fa4": None}}, "ms": {"fwd": {"portattn": 1 / value}}}]}
    rows = bench_attention.merge_processes([run(100.0), run(130.0), run(110.0)])
    assert rows[0]["tflops"]["fwd"] == {"portattn": 110.0}
    assert rows[0]["spread"]["fwd"]["portattn"] == [100.0, 130.0]
    assert rows[0]["ms"]["fwd"]["portattn"] == 1 / 110.0


def test_commit_label_marks_a_tree_that_differs_from_head(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import peers
    finally:
        sys.path.pop(0)
    if shutil.which("git") is None:
        pytest.skip("no git")
    monkeypatch.delenv("PORTATTN_COMMIT", raising=False)
    monkeypatch.chdir(tmp_path)
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "x"]):
        if args[0] == "add":
            (tmp_path / "f.txt").write_text("one")
        subprocess.run(["git", *args], check=True, env=env)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    assert peers.commit() == head
    (tmp_path / "f.txt").write_text("two")
    assert peers.commit() == head + "+dirty"
    (tmp_path / "new.txt").write_text("untracked files do not count")
    (tmp_path / "f.txt").write_text("one")
    assert peers.commit() == head
    monkeypatch.setenv("PORTATTN_COMMIT", "abc1234")
    assert peers.commit() == "abc1234"


def test_short_points_come_from_peers_without_an_import_cycle():
    sys.path.insert(0, BENCH)
    try:
        import peers
    finally:
        sys.path.pop(0)
    point = peers.parse_point("16:50:causal", short=True)
    assert isinstance(point, peers.ShortPoint) and (point.batch, point.heads) == (512, 16)
    assert peers.parse_point("128:1024:full").batch == 16
    # bench_short.py imports peers.py; peers.py imports no benchmark script.
    with open(os.path.join(BENCH, "peers.py")) as handle:
        assert "import bench_" not in handle.read()


def test_run_all_dry_run_writes_tables_logs_and_a_pack(tmp_path):
    out = tmp_path / "out"
    done = _run(["bash", "bench/run_all.sh", str(out), "short", "determinism", "tests"],
                env={"DRY": "1", "PACK": "1", "PORTATTN_COMMIT": "abc1234"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["results.tgz"]
    import tarfile

    with tarfile.open(out / "results.tgz") as pack:
        names = {os.path.normpath(name) for name in pack.getnames()}
        table = pack.extractfile("./short_seq.md").read().decode()
    assert {"short_seq.md", "short_seq.json", "determinism.md", "logs/short.log", "logs/determinism.log",
            "logs/tests.log", "logs/stages.txt"} <= names
    assert "commit: abc1234" in table and "device: cpu (DRY RUN" in table
    done = _run(["bash", "bench/run_all.sh", str(tmp_path / "other"), "no_such_stage"], env={"DRY": "1"})
    assert done.returncode == 2 and "unknown stage" in done.stdout


def test_context_parallel_profile_summary_sorts_kernels_into_categories():
    """bench_context_parallel.profile_summary on a synthetic trace (microseconds) whose every
    category has a known time: the compute stream (7) runs the attention kernels; stream 20 NCCL."""
    sys.path[:0] = [ROOT, BENCH]
    try:
        from bench_context_parallel import profile_summary
    finally:
        del sys.path[:2]

    def annotation(name, start, end):
        return {"cat": "user_annotation", "name": name, "ts": start, "dur": end - start}

    def kernel(name, ts, dur, correlation, stream=7):
        return [{"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream, "correlation": correlation}},
                {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": LAUNCH[correlation], "dur": 1,
                 "args": {"correlation": correlation}}]

    LAUNCH = {1: 10, 2: 45, 3: 60, 4: 150, 5: 160, 6: 20, 7: 170}
    events = [annotation("cp::forward", 0, 100), annotation("cp::merge", 40, 50), annotation("cp::backward", 100, 300)]
    events += kernel("void portattn::cuda::fwd_kernel<128>(PortattnFwdParams)", 1000, 500, 1)
    events += kernel("at::native::vectorized_elementwise_kernel<sigmoid>", 1500, 50, 2)  # launched in cp::merge
    events += kernel("at::native::vectorized_elementwise_kernel<add>", 1600, 20, 3)
    events += kernel("void portattn::cuda::bwd_kernel<128>(BwdArgs)", 1700, 800, 4)
    events += kernel("at::native::vectorized_elementwise_kernel<add>", 2500, 30, 5)
    events += kernel("portattn::cuda::bwd_convert_dq(BwdArgs, int)", 2530, 10, 7)
    events += kernel("ncclDevKernel_SendRecv(ncclDevKernelArgs)", 1650, 30, 6, stream=20)
    summary = profile_summary({"traceEvents": events})
    expected = {"attention kernels": 1.3, "attention per-call passes": 0.01, "merge": 0.05,
                "other elementwise (fwd)": 0.02, "other elementwise (bwd)": 0.03,
                "idle: NCCL kernel running": 0.03, "idle: host gap": 0.1}
    assert summary["categories_ms"] == pytest.approx(expected)
    assert summary["step_ms"] == pytest.approx(1.54) and summary["nccl_kernel_ms"] == pytest.approx(0.03)
    assert summary["nccl_beside_attention_ms"] == 0  # the NCCL kernel ran in the compute stream's gap
    # The same trace with a second NCCL kernel half under the backward kernel (2400-2600: 100 us beside it).
    LAUNCH[8] = 180
    events += kernel("ncclDevKernel_SendRecv(ncclDevKernelArgs)", 2400, 200, 8, stream=20)
    summary = profile_summary({"traceEvents": events})
    assert summary["nccl_beside_attention_ms"] == pytest.approx(0.1) and summary["nccl_kernel_ms"] == pytest.approx(0.23)

    assert sum(expected.values()) == pytest.approx(summary["step_ms"])  # the categories cover the step


def test_context_parallel_rank_profile_places_the_step_on_the_host_clock():
    """bench_context_parallel.rank_profile and its per-rank table on synthetic traces of two ranks
    (microseconds): the compute stream (7) runs two attention kernels and an elementwise one, stream
    20 two NCCL kernels; rank 1's trace is rank 0's on a base time 250 us later."""
    sys.path[:0] = [ROOT, BENCH]
    try:
        from bench_context_parallel import _rank_lines, rank_profile
    finally:
        del sys.path[:2]

    launch = {1: 110, 2: 150, 3: 120, 4: 300, 5: 310}
    events = [{"cat": "user_annotation", "name": "cp::forward", "ts": 100, "dur": 300}]
    for name, ts, dur, correlation, stream in (
            ("void portattn::cuda::fwd_kernel<128>(PortattnFwdParams)", 1000, 300, 1, 7),
            ("ncclDevKernel_SendRecv(ncclDevKernelArgs)", 990, 400, 3, 20),  # beside the first attention kernel
            ("at::native::vectorized_elementwise_kernel<add>", 1400, 50, 2, 7),  # 90 us waiting on NCCL, 10 host gap
            ("void portattn::cuda::fwd_kernel<128>(PortattnFwdParams)", 1500, 200, 4, 7),  # after a 50 us host gap
            ("ncclDevKernel_SendRecv(ncclDevKernelArgs)", 1600, 150, 5, 20)):  # 100 us beside attention
        events += [{"cat": "kernel", "name": name, "ts": ts, "dur": dur,
                    "args": {"stream": stream, "correlation": correlation}},
                   {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launch[correlation], "dur": 5,
                    "args": {"correlation": correlation}}]
    base_ns = 1_700_000_000_000_000_000
    rank0 = rank_profile({"traceEvents": events, "baseTimeNanoseconds": base_ns, "host_name": "node"}, 0, 0.9)
    base = base_ns // 1000
    assert {k: v for k, v in rank0.items() if k != "summary"} == {
        "rank": 0, "host": "node", "timed_ms": 0.9, "forward_host_start_us": base + 100,
        "first_compute_kernel_us": base + 1000, "last_compute_kernel_end_us": base + 1700,
        "first_nccl_kernel_us": base + 990, "last_nccl_kernel_end_us": base + 1750}
    summary = rank0["summary"]
    assert summary["categories_ms"] == pytest.approx({
        "attention kernels": 0.5, "attention per-call passes": 0.0, "merge": 0.0, "other elementwise (fwd)": 0.05,
        "other elementwise (bwd)": 0.0, "idle: NCCL kernel running": 0.09, "idle: host gap": 0.06})
    assert summary["step_ms"] == pytest.approx(0.7) and summary["nccl_kernel_ms"] == pytest.approx(0.55)
    assert summary["nccl_beside_attention_ms"] == pytest.approx(0.4)
    rank1 = rank_profile({"traceEvents": events, "baseTimeNanoseconds": base_ns + 250_000, "host_name": "node"}, 1, 1.2)
    assert rank1["first_compute_kernel_us"] - rank0["first_compute_kernel_us"] == 250
    lines = _rank_lines(4096, "ring", json.loads(json.dumps([rank0, rank1])), "forward")  # as read back by --render
    assert lines[1].startswith("Per-rank timeline of one forward step, ring, 2 ranks, 4096 tokens")
    assert lines[5:] == [
        "| 0 | 0.00 | 0.00 | 0.70 | 0.70 | 0.90 | 0.50 | 0.55 | 0.40 | 0.09 | 0.06 | -0.01 / 0.75 |",
        "| 1 | 0.25 | 0.25 | 0.95 | 0.70 | 1.20 | 0.50 | 0.55 | 0.40 | 0.09 | 0.06 | 0.24 / 1.00 |", "",
        "Across the ranks: the step spans 0.95 ms (the latest last compute kernel's end less the earliest first "
        "compute kernel's start); the first compute kernels start within 0.25 ms of each other, the hosts' "
        "cp::forward within 0.25 ms."]
    # A CPU run's trace: no kernels, the host's start only.
    cpu = rank_profile({"traceEvents": events[:1], "baseTimeNanoseconds": base_ns}, 0, 3.0)
    assert cpu["forward_host_start_us"] == base + 100 and cpu["first_compute_kernel_us"] is None
    assert _rank_lines(64, "ring", [cpu], "forward")[5] == (
        "| 0 | 0.00 | n/a | n/a | 0.00 | 3.00 | 0.00 | 0.00 | 0.00 | 0.00 | 0.00 | n/a / n/a |")


def test_context_parallel_dry_run_times_the_variants_and_profiles(tmp_path):
    """bench_context_parallel.py under torchrun, 2 CPU processes over gloo (--dry-run)."""
    import socket

    with socket.socket() as probe:  # a free port for torchrun's rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
                 "bench/bench_context_parallel.py", "--dry-run", "--tokens", "64", "--reps", "1", "--profile",
                 "--variants", "ring,portattn,portattn+hp", "--profile-variants", "ring,portattn",
                 "--torch-cp", "math/allgather", "--out", str(tmp_path)], env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "context_parallel_2gpu.json").read_text())
    (row,) = result["rows"]
    assert set(row["variants"]) == {"portattn", "ring", "portattn+hp"} and set(result["profiles"]) == {"portattn", "ring"}
    assert all(row["variants"][m]["fwd_bwd"] > 0 for m in row["variants"])
    # PyTorch's context parallelism is timed or its error recorded (a prototype API; on gloo it may refuse).
    assert set(row["torch_cp"]) == {"math/allgather"}
    assert row["torch_cp"]["math/allgather"].get("fwd_bwd", 0) > 0 or row["torch_cp"]["math/allgather"]["error"]
    markdown = (tmp_path / "context_parallel_2gpu.md").read_text()
    assert "| 64 | 2 | ring |" in markdown and "| 64 | 2 | portattn+hp |" in markdown and "| 64 | math/allgather |" in markdown
    assert (tmp_path / "context_parallel_2gpu.png").stat().st_size > 0
    # --render writes the same tables from the JSON alone (a transfer may bring back only that).
    again = _run([sys.executable, "bench/bench_context_parallel.py", "--render",
                  str(tmp_path / "context_parallel_2gpu.json"), "--out", str(tmp_path / "again")])
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "again" / "context_parallel_2gpu.md").read_text() == markdown


def test_context_parallel_dry_run_profiles_every_rank(tmp_path):
    """--profile-all-ranks under torchrun, 2 CPU processes over gloo: every rank's entry gathered to
    rank 0 (no kernels on a CPU: the host's start of cp::forward and n/a kernel times), the traces
    removed, and the per-rank tables rendered again from the JSON."""
    import glob
    import socket
    import tempfile

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    traces = os.path.join(tempfile.gettempdir(), "context_parallel_2gpu_64_*_rank*.json")
    before = set(glob.glob(traces))
    done = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
                 "bench/bench_context_parallel.py", "--dry-run", "--tokens", "64", "--reps", "1", "--profile",
                 "--profile-all-ranks", "--profile-forward-only", "--variants", "ring,portattn",
                 "--out", str(tmp_path)],
                env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert set(glob.glob(traces)) == before
    result = json.loads((tmp_path / "context_parallel_2gpu.json").read_text())
    assert result["profile_mode"] == "fwd" and set(result["rank_profiles"]) == {"ring", "portattn"}
    for name, entries in result["rank_profiles"].items():
        assert [e["rank"] for e in entries] == [0, 1]
        assert result["profiles"][name] == entries[0]["summary"]
        for e in entries:
            assert e["forward_host_start_us"] > 1e15 and e["timed_ms"] > 0  # microseconds since the epoch
            assert e["first_compute_kernel_us"] is None and e["first_nccl_kernel_us"] is None
            assert e["summary"]["step_ms"] == 0.0
    markdown = (tmp_path / "context_parallel_2gpu.md").read_text()
    for name in ("ring", "portattn"):
        assert f"Per-rank timeline of one forward step, {name}, 2 ranks, 64 tokens" in markdown
    assert markdown.count("| 1 | ") == 2 and markdown.count("n/a / n/a |") == 4
    assert markdown.count("Across the ranks: no kernels in the traces; the hosts' cp::forward start within ") == 2
    again = _run([sys.executable, "bench/bench_context_parallel.py", "--render",
                  str(tmp_path / "context_parallel_2gpu.json"), "--out", str(tmp_path / "again")])
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "again" / "context_parallel_2gpu.md").read_text() == markdown


def test_merge_bench_dry_run(tmp_path):
    result = _tool_result(tmp_path, "tools/bench_merge.py", "--dry-run", "--reps", "1", result="merge_bench")
    assert [r["tokens"] for r in result["rows"]] == [64, 128]
    assert all(r[f"{k}_{m}_ms"] > 0 for r in result["rows"] for k in ("full", "half") for m in ("ring", "portattn"))
