"""Continuous batching: new requests join a running decode batch, finished ones leave it.

    python examples/serve_batch.py                 # a random tiny model, 8 requests arriving over time
    python examples/serve_batch.py --slots 2       # fewer state slots: requests wait for a free one

The decode state is a pool of ``--slots`` slots (one :class:`portable_ssm.Mamba2State` of batch
``slots``). Each tick, arrived requests take free slots: each is prefilled alone
(``lm.logits(..., return_state=True)``) and its state written into its slot
(``portable_ssm.state_pool.write_state``); then one ``lm.logits_step`` runs over the busy slots
only (``state_batch_indices``), and the requests that reached their token budget or eos give their
slot back. Decoding is greedy, so every request gets exactly the tokens of its own solo
``generate``, which the script checks; its last stdout line is a JSON summary.

Requests are checked before any is served (:func:`check_requests`): a prompt that is not a
non-empty list of token ids below the vocabulary, a token budget that is not an int >= 0 or an
arrival that is not an int >= 0 is a TypeError/ValueError naming ``requests[i]``; a budget of 0
gives no tokens and takes no slot.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import numpy as np

import portable_ssm as ps
from portable_ssm import lm
from portable_ssm._checks import check_int
from portable_ssm.generation import generate
from portable_ssm.generation_options import check_id
from portable_ssm.prompts import check_prompt
from portable_ssm.state_pool import write_state


@dataclass(frozen=True)
class Request:
    """A prompt, its token budget and the tick at which it arrives."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival: int = 0


def check_requests(requests: list[Request], config: ps.Mamba2Config, slots: int, eos_token_id: int | None) -> None:
    """TypeError/ValueError naming the request or argument unless every request is a
    :class:`Request` with a non-empty prompt of ids in ``[0, vocab_size)``, an int budget >= 0 and
    an int arrival >= 0, ``slots`` an int >= 1 and ``eos_token_id`` None or an id."""
    if not isinstance(requests, (list, tuple)):
        raise TypeError(f"requests: expected a list of Request, got {type(requests).__name__}")
    check_int("slots", slots, minimum=1)
    if eos_token_id is not None:
        check_id("eos_token_id", eos_token_id, config.vocab_size)
    for i, r in enumerate(requests):
        if not isinstance(r, Request):
            raise TypeError(f"requests[{i}]: expected a Request, got {type(r).__name__}")
        check_prompt(f"requests[{i}].prompt", r.prompt, config.vocab_size)
        check_int(f"requests[{i}].max_new_tokens", r.max_new_tokens, minimum=0)
        check_int(f"requests[{i}].arrival", r.arrival, minimum=0)


def serve(params: dict, config: ps.Mamba2Config, requests: list[Request], slots: int,
          eos_token_id: int | None = None) -> tuple[list[list[int]], int]:
    """Every request run to completion through a pool of ``slots`` states (numpy, greedy): each
    request's new tokens, and the number of decode steps taken (each over all busy slots). The
    requests are checked first (:func:`check_requests`)."""
    check_requests(requests, config, slots, eos_token_id)
    pool = ps.empty_state(config, slots, params["embedding.weight"])
    free, busy = list(range(slots)), {}  # busy: slot -> request index
    waiting = sorted(range(len(requests)), key=lambda r: requests[r].arrival)
    outputs: list[list[int]] = [[] for _ in requests]

    def done(r: int) -> bool:
        out = outputs[r]
        return len(out) >= requests[r].max_new_tokens or (eos_token_id is not None and out[-1] == eos_token_id)

    tick = steps = 0
    while waiting or busy:
        while waiting and requests[waiting[0]].arrival <= tick:  # admit, in arrival order
            if requests[waiting[0]].max_new_tokens == 0:
                waiting.pop(0)  # nothing to generate: no slot, no prefill
                continue
            if not free:
                break
            r, slot = waiting.pop(0), free.pop(0)
            logits, state = lm.logits(np.asarray([requests[r].prompt]), params, config=config, return_state=True)
            pool = write_state(pool, np.asarray([slot]), state)
            outputs[r].append(int(np.argmax(logits[0, -1])))
            if done(r):
                free.append(slot)
            else:
                busy[slot] = r
        if busy:  # one decode step over the busy slots
            order = np.asarray(sorted(busy))
            tokens = np.asarray([outputs[busy[s]][-1] for s in order])
            logits, pool = lm.logits_step(tokens, pool, params, config=config, state_batch_indices=order)
            steps += 1
            for slot, token in zip(order.tolist(), np.argmax(logits, axis=-1).tolist()):
                r = busy[slot]
                outputs[r].append(token)
                if done(r):  # retire: the slot is free for the next request
                    del busy[slot]
                    free.append(slot)
        tick += 1
    return outputs, steps


def solo(params: dict, config: ps.Mamba2Config, request: Request, eos_token_id: int | None = None) -> list[int]:
    """The request generated alone: the tokens :func:`serve` must give it."""
    ids = generate(np.asarray([request.prompt]), params, config=config, max_new_tokens=request.max_new_tokens,
                   eos_token_id=eos_token_id)
    return ids[0, len(request.prompt):].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", type=int, default=3, help="decode state slots in the pool")
    parser.add_argument("--requests", type=int, default=8, help="requests to serve")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = ps.Mamba2Config(d_model=32, n_layer=2, d_state=16, headdim=8, vocab_size=64, pad_vocab_size_multiple=1)
    params = ps.init_params(config, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    requests = [Request(tuple(rng.integers(0, 64, int(rng.integers(1, 12))).tolist()), int(rng.integers(1, 10)),
                        arrival=2 * i) for i in range(args.requests)]
    outputs, steps = serve(params, config, requests, args.slots)
    matches = all(out == solo(params, config, r) for out, r in zip(outputs, requests))
    for r, out in zip(requests, outputs):
        print(f"arrival {r.arrival:>2}  prompt {len(r.prompt):>2} tokens  -> {out}")
    print(json.dumps({"requests": len(requests), "slots": args.slots, "decode_steps": steps,
                      "tokens": sum(len(o) for o in outputs), "equal_to_solo": matches}))


if __name__ == "__main__":
    main()
