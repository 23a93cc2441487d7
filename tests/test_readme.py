"""The README's library example runs as written (examples that nothing runs rot)."""

import re
from pathlib import Path

from transformers import AutoModelForCausalLM


def test_readme_api_example_runs(tmp_path, monkeypatch):
    text = (Path(__file__).parents[1] / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "plan_pruning" in b]
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], "README.md", "exec"), {})
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "compact-model")
    assert model.config.num_hidden_layers == 5
