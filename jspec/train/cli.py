"""`jspec-train`: train a draft for a local target on your text: an EAGLE-3 head or a
DFlash block drafter.

    jspec-train eagle3 --target DIR --data PATH [PATH ...] --out DIR [options]
    jspec-train dflash --target DIR --data PATH [PATH ...] --out DIR [--block-size 16] [options]

Data: text files, directories (walked; --ext filters by name ending) and .jsonl files with
a "text" field per line. An EAGLE-3 head is written in the LlamaForCausalLMEagle3 format
that jspec, SGLang and vLLM load; a DFlash drafter in z-lab's DFlashDraftModel format.
Re-running with the same --out resumes from its checkpoint.
"""
from __future__ import annotations

import argparse
import sys


def _common_args(ap: argparse.ArgumentParser, exported: str, lr: float):
    """The flags every trainer takes: target, data, output, steps, batch, optimiser."""
    ap.add_argument("--target", required=True, help="local Hugging Face directory of the target")
    ap.add_argument("--data", required=True, nargs="+", help="text files, directories or .jsonl files")
    ap.add_argument("--out", required=True, help=f"output directory (checkpoints and {exported})")
    ap.add_argument("--ext", nargs="*", default=None, help="in directories, keep files ending with these")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--warmup", type=int, default=100)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="jspec-train", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("eagle3", help="train an EAGLE-3 head (training-time test) for a target")
    _common_args(e, "the exported head", lr=5e-4)
    e.add_argument("--ttt-steps", type=int, default=4, help="draft steps unrolled in training")
    e.add_argument("--draft-vocab", type=int, default=None, help="draft vocabulary size (most frequent tokens)")
    e.add_argument("--aux-layer-ids", type=int, nargs="+", default=None, metavar="ID",
                   help="target layers whose outputs feed the head, 0-based, as SGLang's "
                        "eagle_aux_hidden_state_layer_ids (default: 1, n/2 - 1, n - 4 for an n-layer target, each "
                        "clamped into 0..n-1)")
    e.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (master weights stay float32)")
    e.add_argument("--checkpoint-every", type=int, default=500)
    e.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint in --out")
    f = sub.add_parser("dflash", help="train a DFlash block drafter (the block-diffusion objective) for a target")
    _common_args(f, "the exported drafter", lr=6e-4)
    f.add_argument("--block-size", type=int, default=16, help="tokens a block proposes, the root included")
    f.add_argument("--blocks-per-seq", type=int, default=None, help="anchors a sequence (default seq-len / block)")
    f.add_argument("--layers", type=int, default=1, help="the drafter's decoder layers")
    f.add_argument("--loss-decay", type=float, default=0.0,
                   help="weight block slot i by exp(-(i-1)/decay) (0: equal weights)")
    f.add_argument("--target-layer-ids", type=int, nargs="+", default=None, metavar="ID",
                   help="target layers whose outputs feed the drafter, 0-based (default: 5 spread from 1 to n-3)")
    f.add_argument("--mask-token-id", type=int, default=None,
                   help="the id filling a block (default: the pad token, else the corpus' rarest id)")
    f.add_argument("--target-text", type=int, default=0, metavar="N",
                   help="also train on the target's own text: N windows of 64 corpus tokens, each continued by the "
                        "target (greedy) to --seq-len (0: the corpus alone)")
    f.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (master weights stay float32)")
    f.add_argument("--checkpoint-every", type=int, default=500)
    f.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint in --out")
    args = ap.parse_args(argv)

    from jspec.train import DFlashTrainConfig, Eagle3TrainConfig, train_dflash, train_eagle3
    try:
        if args.cmd == "dflash":
            cfg = DFlashTrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                                    warmup=args.warmup, block_size=args.block_size,
                                    blocks_per_seq=args.blocks_per_seq, num_layers=args.layers,
                                    loss_decay=args.loss_decay, compute_dtype=args.dtype,
                                    checkpoint_every=args.checkpoint_every, target_text=args.target_text)
            _, history = train_dflash(args.target, args.data, args.out, cfg, layer_ids=args.target_layer_ids,
                                      mask_token_id=args.mask_token_id, extensions=args.ext,
                                      resume=not args.no_resume)
        else:
            cfg = Eagle3TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                                    warmup=args.warmup, ttt_steps=args.ttt_steps, draft_vocab_size=args.draft_vocab,
                                    compute_dtype=args.dtype, checkpoint_every=args.checkpoint_every)
            aux = None if args.aux_layer_ids is None else [i + 1 for i in args.aux_layer_ids]
            _, history = train_eagle3(args.target, args.data, args.out, cfg, aux_layers=aux, extensions=args.ext,
                                      resume=not args.no_resume)
    except (ValueError, TypeError) as err:
        print(f"jspec-train: error: {err}", file=sys.stderr)
        return 2
    last = history[-1] if history else {}
    print(f"wrote {args.out}: " + " ".join(f"{k}={v:.3f}" for k, v in last.items() if isinstance(v, float)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
