"""Train the bundled `pylm` checkpoint: a small Llama on the Python standard library's own sources, on CPU.

    python tools/train_pylm.py --minutes 16 --out runtime/chunkwise/engine/model/bundled/pylm

Everything is made here, offline, from the local interpreter's standard library (PSF License):

1. The corpus: every UTF-8 `*.py` file under `sysconfig.get_paths()["stdlib"]`, except test directories,
   site-packages and generated tables (see `EXCLUDED_PARTS`). One file in `HELD_OUT_EVERY` (by a CRC of
   its relative path) is held out for the evaluation loss and the benchmark prompts.
2. A byte-level BPE `tokenizer.json` (the `tokenizers` library) trained on the training files, with the
   special tokens of `SPECIAL_TOKENS` and the chat template of `CHAT_TEMPLATE`.
3. The training stream: each file as `<|begin_of_text|>source<|end_of_text|>`, plus one chat exchange per
   documented function (the docstring's first paragraph as the user's turn, the function as the
   assistant's), so that chat requests are answered with code that ends by `<|end|>`.
4. A transformers `LlamaForCausalLM` trained with AdamW for a wall-clock budget (the learning rate warms up,
   then follows a cosine over the budget), a fixed seed, then saved in Hugging Face format (float32 when that fits 16 MB, else bfloat16).

Progress lines go to stderr: step, loss, learning rate, tokens/s. `training.json` in the output directory
records the corpus, the shape, the time and the losses.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing as mp
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from chunkwise.engine.model.bundled.pylm_corpus import (
    BOS,
    CHAT_TEMPLATE,
    END_OF_TURN,
    EOS,
    SPECIAL_TOKENS,
    chat_exchanges,
    chat_text,
    split_corpus,
    stdlib_dir,
)

MAX_WEIGHT_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Shape:
    vocab_size: int = 4096
    hidden_size: int = 192
    intermediate_size: int = 576
    num_hidden_layers: int = 4
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def write_tokenizer_files(tok: Any, out: Path) -> dict[str, int]:
    ids = {t: int(tok.token_to_id(t)) for t in SPECIAL_TOKENS}
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in ids.items()
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": Shape().max_position_embeddings,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}, indent=2) + "\n", encoding="utf-8"
    )
    return ids


def encode_stream(tok: Any, docs: list[str], ids: dict[str, int]) -> list[int]:
    """Each document as BOS + tokens + EOS, concatenated in order."""
    stream: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        stream.append(ids[BOS])
        stream.extend(enc.ids)
        stream.append(ids[EOS])
    return stream


def prepare_data(
    root: Path, out: Path, vocab_size: int, seed: int, tmp: Path, init_from: Path | None = None
) -> dict[str, Any]:
    """Split the corpus, train and write the tokenizer (or keep init_from's), and save the token streams to
    tmp/{train,held}.npy."""
    import numpy as np

    t_start = time.perf_counter()
    train_texts, held_texts = split_corpus(root)
    corpus_bytes = sum(len(t.encode()) for t in train_texts.values())
    held_bytes = sum(len(t.encode()) for t in held_texts.values())
    digest = hashlib.sha256()
    every = {**train_texts, **held_texts}
    for rel in sorted(every):
        digest.update(rel.encode() + b"\0" + every[rel].encode() + b"\0")
    print(
        f"corpus {root}: {len(train_texts)} training files ({corpus_bytes / 1e6:.2f} MB), "
        f"{len(held_texts)} held out ({held_bytes / 1e6:.2f} MB)",
        file=sys.stderr,
    )
    if init_from is None:
        tok = train_tokenizer(list(train_texts.values()), vocab_size)
    else:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(init_from / "tokenizer.json"))
    ids = write_tokenizer_files(tok, out)
    vocab = int(tok.get_vocab_size(with_added_tokens=True))
    print(f"tokenizer: {vocab} ids ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr)

    exchanges = [chat_text(a, s) for text in train_texts.values() for a, s in chat_exchanges(text)]
    docs = list(train_texts.values()) + exchanges
    random.Random(seed).shuffle(docs)
    train_stream = np.asarray(encode_stream(tok, docs, ids), dtype=np.int64)
    held_stream = np.asarray(encode_stream(tok, list(held_texts.values()), ids), dtype=np.int64)
    print(
        f"training stream: {len(train_stream)} tokens ({len(exchanges)} chat exchanges), "
        f"held out {len(held_stream)} tokens",
        file=sys.stderr,
    )

    np.save(tmp / "train.npy", train_stream)
    np.save(tmp / "held.npy", held_stream)
    return {
        "ids": ids,
        "vocab": vocab,
        "corpus": {
            "root": str(root),
            "python": sys.version.split()[0],
            "training_files": len(train_texts),
            "training_bytes": corpus_bytes,
            "held_out_files": sorted(held_texts),
            "held_out_bytes": held_bytes,
            "sha256": digest.hexdigest(),
            "chat_exchanges": len(exchanges),
            "training_tokens_in_stream": len(train_stream),
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/train_pylm.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "pylm")
    p.add_argument("--stdlib", type=Path, default=None, help="corpus root (default: this interpreter's)")
    p.add_argument("--minutes", type=float, default=16.0, help="training wall-clock budget (default 16)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--lr", type=float, default=2.5e-3, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--seed", type=int, default=20)
    p.add_argument("--hidden-size", type=int, default=Shape.hidden_size)
    p.add_argument("--intermediate-size", type=int, default=Shape.intermediate_size)
    p.add_argument("--layers", type=int, default=Shape.num_hidden_layers)
    p.add_argument("--heads", type=int, default=Shape.num_attention_heads)
    p.add_argument("--kv-heads", type=int, default=Shape.num_key_value_heads)
    p.add_argument("--vocab-size", type=int, default=Shape.vocab_size)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="continue training this checkpoint (its weights and tokenizer) instead of a fresh one",
    )
    args = p.parse_args(argv)

    import numpy as np
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    shape = Shape(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
    )
    root = args.stdlib or stdlib_dir()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    # The tokenizer's worker threads, once started, slow torch's CPU threads down fivefold: the data is made
    # in a child process, which hands the token streams back as .npy files.
    with tempfile.TemporaryDirectory() as tmp, mp.get_context("spawn").Pool(1) as pool:
        previous: dict[str, Any] | None = None
        if args.init_from is not None:
            previous = json.loads((args.init_from / "training.json").read_text(encoding="utf-8"))
            init_model = LlamaForCausalLM.from_pretrained(str(args.init_from), dtype=torch.float32)
        data = pool.apply(prepare_data, (root, out, shape.vocab_size, args.seed, Path(tmp), args.init_from))
        train_stream = np.load(Path(tmp) / "train.npy")
        held_stream = np.load(Path(tmp) / "held.npy")
    ids = data["ids"]
    vocab = data["vocab"]
    print(f"data ready ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr)

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=ids[BOS],
        eos_token_id=[ids[EOS], ids[END_OF_TURN]],
        pad_token_id=ids[EOS],
    )
    model = LlamaForCausalLM(config) if args.init_from is None else init_model
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, {shape}", file=sys.stderr)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = np.random.default_rng(args.seed)
    budget = args.minutes * 60.0
    seq = args.seq_len

    def batch(stream: np.ndarray, starts: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.stack([stream[s : s + seq] for s in starts]))

    def held_out_loss(windows: int = 64) -> float:
        model.eval()
        starts = np.linspace(0, len(held_stream) - seq - 1, windows).astype(np.int64)
        losses = []
        with torch.no_grad():
            for i in range(0, windows, 16):
                x = batch(held_stream, starts[i : i + 16])
                losses.append(float(model(input_ids=x, labels=x).loss))
        model.train()
        return sum(losses) / len(losses)

    model.train()
    t0 = time.perf_counter()
    step = 0
    tokens = 0
    ema: float | None = None
    history = []
    while True:
        elapsed = time.perf_counter() - t0
        if elapsed >= budget or (args.max_steps is not None and step >= args.max_steps):
            break
        progress = elapsed / budget if args.max_steps is None else step / args.max_steps
        lr = (
            args.lr
            * min(1.0, (step + 1) / args.warmup_steps)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        )
        for group in opt.param_groups:
            group["lr"] = lr
        x = batch(train_stream, gen.integers(0, len(train_stream) - seq - 1, args.batch_size))
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x.numel()
        value = float(loss.detach())
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        if step % args.log_every == 0:
            t = time.perf_counter() - t0
            print(
                f"step {step} loss {value:.3f} (avg {ema:.3f}) lr {lr:.2e} {tokens / t:.0f} tokens/s "
                f"{t / 60:.1f} min",
                file=sys.stderr,
                flush=True,
            )
            history.append({"step": step, "loss": round(ema, 4), "minutes": round(t / 60, 2)})
    train_seconds = time.perf_counter() - t0
    held = held_out_loss()
    print(
        f"done: {step} steps, {tokens} tokens in {train_seconds / 60:.1f} min; held-out loss {held:.3f}",
        file=sys.stderr,
    )

    model.eval()
    # float32 when it fits the 16 MB the repository allows, else bfloat16.
    if n_params * 4 > MAX_WEIGHT_BYTES:
        model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=[ids[EOS], ids[END_OF_TURN]], pad_token_id=ids[EOS]
    ).save_pretrained(out)
    record = {
        "corpus": data["corpus"],
        "shape": asdict(shape),
        "parameters": n_params,
        "seed": args.seed,
        "seq_len": seq,
        "batch_size": args.batch_size,
        "peak_lr": args.lr,
        "threads": args.threads,
        "steps": step,
        "tokens_seen": tokens,
        "training_minutes": round(train_seconds / 60, 2),
        "final_train_loss": round(ema or float("nan"), 4),
        "held_out_loss": round(held, 4),
        "loss_history": history,
        # The run this one continued (--init-from), with its own record.
        "continued_from": previous,
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"saved {out} ({time.perf_counter() - t_start:.0f} s in all)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
