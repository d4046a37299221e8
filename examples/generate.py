"""Greedy generation with Hugging Face models under pydisc and eagerly, side by side: `generate()` with
its default KV cache, and a hand-written decoding loop with one `mark_step()` per token.

The models are `transformers`' GPT-2 and Llama (RoPE, grouped-query attention), built from small configs
with random weights, or GPT-2 with the weights `hf_finetune.py --save` wrote. Each token's step reads a
KV cache one position longer than the last: pydisc makes that length a dynamic dim after two tokens and
serves every later token from one compiled plan (docs/dynamic.md), where a compiler that specialises on
shapes compiles once per length.

Exit status: 1 when pydisc's tokens differ from eager's.

    python examples/generate.py                               # ~30 seconds on 2 CPU cores
    python examples/generate.py --model llama --tokens 64
    python examples/hf_finetune.py --save /tmp/g.pt && python examples/generate.py --weights /tmp/g.pt
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
import pydisc  # noqa: E402
from hf_finetune import BOS, EOS, PAD, VOCAB, build_model  # noqa: E402


def llama(layers: int, dim: int, context: int):
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                         bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    return LlamaForCausalLM(config)


def decode_by_hand(model, prompt: torch.Tensor, tokens: int, lazy: bool) -> torch.Tensor:
    """Greedy decoding with HF's KV cache: the prompt once, then one token per forward."""
    ids, past = prompt, None
    with torch.no_grad():
        for _ in range(tokens):
            out = model(ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            if lazy:
                pydisc.mark_step()       # runs this token's step; its result is read just below
            ids = torch.cat([ids, token.to(ids.device)], 1)
    return ids


def text(ids: torch.Tensor) -> str:
    return bytes(i for i in ids.tolist() if i < 256).decode("ascii", "replace")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--weights", help="a GPT-2 state dict written by hf_finetune.py --save")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    context = 16 + args.tokens
    torch.manual_seed(0)
    eager = (build_model if args.model == "gpt2" else llama)(args.layers, args.dim, max(context, 48))
    if args.weights:
        eager.load_state_dict(torch.load(args.weights, map_location="cpu"))
    eager = eager.to(args.device).eval()
    lazy = pydisc.lazy(copy.deepcopy(eager))
    prompt = torch.tensor([[BOS] + list(b"def main(")], device=args.device)
    failed = False
    for how in ("generate", "by hand"):
        pydisc.reset_metrics()
        timings = {}
        results = {}
        for name, model in (("pydisc", lazy), ("eager", eager)):
            started = time.perf_counter()
            if how == "generate":
                with torch.no_grad():
                    results[name] = model.generate(prompt, max_new_tokens=args.tokens, do_sample=False,
                                                   pad_token_id=PAD).cpu()
            else:
                results[name] = decode_by_hand(model, prompt, args.tokens, lazy=name == "pydisc").cpu()
            timings[name] = time.perf_counter() - started
        m = pydisc.metrics()
        same = torch.equal(results["pydisc"], results["eager"])
        failed |= not same
        print("%s, %d tokens: %s (pydisc %.2f s, eager %.2f s)" % (
            how, args.tokens, "pydisc and eager agree" if same else "TOKENS DIFFER", timings["pydisc"], timings["eager"]))
        print("  plans compiled %d, templates %d, token steps served by one: %d, fallback ops %d" % (
            m["plans_compiled"], m["dynamic_templates"], m["dynamic_matches"], sum(m["fallback_ops"].values())))
        print("  text: %r" % text(results["pydisc"][0]))
    print()
    print(pydisc.metrics_report())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
