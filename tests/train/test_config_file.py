"""`moe train --config FILE`: TOML sections as --help's groups, flags override the file, the
resolved options saved and resumed, bad keys and values named with the file; the shipped
configs/ parse and build their models on the meta device."""

import json
from pathlib import Path

import pytest
import torch

from moe.cli import UsageError, main
from moe.models.llama import PRESETS, Llama
from moe.train.config import TrainConfig, model_config, run_tokenizer
from moe.train.data import load_tokenizer

from .run import ROOT, corpus, moe

CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


def _config_args(path: Path, extra: list[str]) -> dict:
    """The options ``moe train --config PATH EXTRA`` runs with (nothing is launched)."""
    from moe import cli

    parser = cli.build_parser()
    argv = ["train", "--config", str(path), *extra]
    file_values = cli._config_file(parser, argv)
    args = parser.parse_args(argv)
    args._explicit = cli._explicit(parser, argv) | set(file_values)
    cli._check_train(args, parser)
    return vars(args)


@pytest.fixture(scope="module")
def llama_7b_folder(tmp_path_factory):
    """A Llama-2-7B-shaped transformers config.json and a tokenizer.json of its 32,000 tokens
    (no weights: the model is built on meta)."""
    tokenizers = pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("llama-2-7b")
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096, "hidden_act": "silu",
    }))  # fmt: skip
    vocab = {f"t{i}": i for i in range(32000)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_shipped_configs_parse_and_build_on_meta(tmp_path, monkeypatch, llama_7b_folder):
    assert [p.name for p in CONFIGS] == [
        "demo.toml", "llama2-7b-upcycle-base-8gpu.toml", "llama2-moe-1.2t-1024gpu.toml", "mixtral-8x7b-64gpu-ep8.toml",
    ]  # fmt: skip
    monkeypatch.chdir(tmp_path)
    data = corpus(tmp_path)
    for path in CONFIGS:
        extra = ["--force", "--out", str(tmp_path / path.stem)]  # memory: these are sized for GPUs
        text = path.read_text()
        if "data = " in text:
            extra += ["--data", str(data)]
        if "tokenizer = " in text:
            extra += ["--tokenizer", str(llama_7b_folder / "tokenizer.json")]
        if "from_hf = " in text:
            extra += ["--from-hf", str(llama_7b_folder)]
        opts = _config_args(path, extra)
        cfg = TrainConfig.from_dict(opts)
        mc = model_config(cfg, load_tokenizer(run_tokenizer(cfg)).vocab_size)
        with torch.device("meta"):
            model = Llama(mc)
        assert sum(p.numel() for p in model.parameters()) == mc.num_params(), path.name
        if path.stem == "demo":
            assert cfg == TrainConfig(out=cfg.out, dp_shard=1)  # the defaults, as the file says
        if path.stem.startswith("mixtral"):
            assert (opts["pp"], opts["ep"], opts["dp_shard"], opts["nproc"]) == (1, 8, 64, 64)
            assert (opts["reshard"], opts["ep_chunks"], opts["micro_batches"]) == (0, 4, None)
            assert opts["grad_accum"] == 1024 // 64 and mc.num_params() == PRESETS["mixtral-8x7b"].num_params()
        if path.stem.startswith("llama2-moe-1.2t"):  # moe plan's pick for 1024 H200: etp in stages, chunks
            lay = tuple(opts[k] for k in ("tp", "pp", "pp_schedule", "ep", "etp", "dp_shard", "nproc"))
            assert lay == (4, 16, "1f1b", 8, True, 16, 1024) and (opts["ep_chunks"], opts["reshard"]) == (4, 1)
            assert opts["micro_batches"] == 4096 // 16 and mc.num_params() == PRESETS["llama2-moe-1.2t"].num_params()
        if path.stem.startswith("llama2-7b"):
            assert mc.moe.num_experts == 8 and mc.moe.router == "base" and mc.moe_layers == list(range(1, 32, 2))
            assert (opts["ep"], opts["dp_shard"], opts["nproc"]) == (8, 8, 8)


def test_flags_override_the_file_and_resume_reads_the_saved_options(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "tiny"\nrouter = "topk"\n[data]\nbatch = 4\nseq_len = 32\n'
                    'eval_every = 1\n[optimiser]\nsteps = 3\nwarmup = 1\n')  # fmt: skip
    assert _config_args(path, ["--steps", "2", "--out", str(tmp_path / "x")])["steps"] == 2  # the flag wins
    run = tmp_path / "run"
    moe("train", "--config", path, "--data", corpus(tmp_path), "--stop-at", 1, "--out", run)
    saved = json.loads((run / "config.json").read_text())["train"]
    assert (saved["preset"], saved["router"], saved["steps"], saved["seq_len"]) == ("tiny", "topk", 3, 32)
    moe("train", "--out", run, "--resume")  # no file, no flag: the run's own options
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]


BAD = [
    ("[model]\nlr = 0.1\n", "unknown key 'lr' in [model] (it belongs in [optimiser])"),
    ("[model]\npreset = 7\n", "[model] preset must be a string, got 7 (an integer)"),
    ('[data]\nbatch = "8"\n', "[data] batch must be an integer, got '8' (a string)"),
    ("[data]\nbatch = 0\n", "[data] batch: --batch must be >= 1, got 0"),
    ("[optimiser]\nlr = true\n", "[optimiser] lr must be a number, got True (a boolean)"),
    ('[model]\nrouter = "magic"\n', "[model] router must be one of"),
    ("[layout]\netp = 1\n", "[layout] etp must be true or false, got 1 (an integer)"),
    ("[training]\nsteps = 1\n", "unknown section [training]; sections: model, data, optimiser, run, layout"),
    ("[model\n", "not valid TOML"),
]


@pytest.mark.parametrize(("text", "message"), BAD, ids=[m.split(" ")[0] for _, m in BAD])
def test_bad_config_files_exit_2_naming_the_key_and_file(text, message, tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert main(["train", "--config", str(path), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"--config {path}" in err and message in err, err
    with pytest.raises(UsageError):
        _config_args(path, [])


def test_the_round_price_reaches_the_routers_global_base():
    """`--base-round-bytes` (what `moe plan` states a round of global BASE costs) is the BASE
    router's ``base_round_bytes``, which `GroupBalance` hands the solver; unset, the preset's."""
    priced = model_config(TrainConfig(router="base", base_round_bytes=2.25e6), 256)
    assert priced.moe.router_config().base_round_bytes == 2.25e6
    assert model_config(TrainConfig(router="base"), 256).moe.router_config().base_round_bytes == 0.0
