"""README.md's support table is generated from the support matrix and must stay equal to it."""
import os

import pytest

from portattn.capability import render

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
FIX = "python -m portattn.capability.render --write README.md"


def _readme_text() -> str:
    if not os.path.exists(README):
        pytest.skip("README.md does not exist yet")
    with open(README, encoding="utf-8") as fh:
        return fh.read()


def test_readme_block_equals_matrix():
    block = render.readme_block(_readme_text())
    if block is None:
        pytest.skip(f"README.md has no {render.BEGIN} ... {render.END} markers yet")
    assert block == render.readme_table(), f"README support matrix is stale; run: {FIX}"


def test_replace_is_idempotent_and_keeps_surroundings():
    text = f"# Title\n\nintro\n\n{render.BEGIN}\nold table\n{render.END}\n\nafter\n"
    new = render.replace_readme_table(text)
    assert new.startswith("# Title\n\nintro\n\n" + render.BEGIN + "\n")
    assert new.endswith(render.END + "\n\nafter\n")
    assert "old table" not in new
    assert render.replace_readme_table(new) == new
    assert render.readme_block(new) == render.readme_table()


def test_replace_without_markers_raises():
    with pytest.raises(ValueError, match="support-matrix"):
        render.replace_readme_table("# no markers here\n")
    assert render.readme_block("# no markers here\n") is None


def test_table_shape():
    lines = [line for line in render.readme_table().splitlines() if line.startswith("|")]
    widths = {line.count("|") for line in lines}
    assert widths == {len(render.COLUMNS) + 2}, "every row has one cell per column"
    header = lines[0]
    for _, title, _ in render.COLUMNS:
        assert title in header
    # The reference backend column is verified everywhere; paged KV is not in the Hopper path
    # (the sm80+ decode kernels serve it), and compiled on both ROCm archs.
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in lines[2:]}
    assert set(rows["forward"][:1]) == {"✅"}
    assert rows["paged KV cache"][2] == "❌"
    assert rows["paged KV cache"][-2:] == ["🟡", "🟡"]
    assert rows["dtype float32"][1:] == ["❌"] * (len(render.COLUMNS) - 1)


def test_check_cli_detects_stale_file(tmp_path):
    stale = tmp_path / "README.md"
    stale.write_text(f"x\n{render.BEGIN}\nstale\n{render.END}\n", encoding="utf-8")
    assert render.main(["--check", str(stale)]) == 1
    assert render.main(["--write", str(stale)]) == 0
    assert render.main(["--check", str(stale)]) == 0
    assert render.readme_block(stale.read_text(encoding="utf-8")) == render.readme_table()
    no_markers = tmp_path / "OTHER.md"
    no_markers.write_text("nothing\n", encoding="utf-8")
    assert render.main(["--write", str(no_markers)]) == 2
