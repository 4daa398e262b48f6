"""Checkpoints are atomic: a save killed part-way leaves the previous one named by `latest`."""

import pytest
import torch

from moe.train import checkpoint as ckpt


def _model_and_optimizer(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    return model, opt


def test_a_save_killed_while_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer(0)
    ckpt.save_checkpoint(tmp_path, 1, model, opt, {"step": 1}, keep=None)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    real_save = ckpt.dcp.save

    def dies_half_way(state, checkpoint_id):
        real_save(state, checkpoint_id=checkpoint_id)  # the files are there, the rename is not
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(ckpt.dcp, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(tmp_path, 2, model, opt, {"step": 2}, keep=None)
    monkeypatch.undo()

    root = tmp_path / "checkpoints"
    assert (root / ".tmp-step_000002").is_dir() and not (root / "step_000002").exists()
    assert ckpt.choose_checkpoint(tmp_path) == (root / "step_000001", [])
    fresh, fresh_opt = _model_and_optimizer(1)
    assert ckpt.load_checkpoint(root / "step_000001", fresh, fresh_opt) == {"step": 1}
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, saved[k]), k

    ckpt.save_checkpoint(tmp_path, 3, model, opt, {"step": 3}, keep=1)  # clears the partial one, keeps 1
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000003"]
    assert (root / "latest").read_text().strip() == "step_000003"
    assert ckpt.choose_checkpoint(tmp_path) == (root / "step_000003", [])
