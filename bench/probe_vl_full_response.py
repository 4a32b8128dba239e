"""Probe (docs/vlm.md "The VL demo"): plain-torch GRPO on the FULL sampled response (up to <|im_end|>, at most
6 tokens, T=1, image pads never sampled), token-mean loss as plait's actor: no plait trainer, actor or loss.

    python bench/probe_vl_full_response.py <model dir> <steps> <lr>     (SEED=<n>)

Prints (greedy first-token accuracy, mean p(true)) on 128 held-out pictures and the sampled training reward.
"""
import sys, os, random, torch
from plait.models import load_causal_lm
from plait.models_vl import load_processor, vl_inputs, mask_logits, never_sampled
from plait.vl_demo import format_examples
M, steps, lr, S = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(os.environ.get("SEED", "0"))
torch.manual_seed(S); rng = random.Random(S)
proc = load_processor(M); model = load_causal_lm(M); model.train()
tok = proc.tokenizer; pad = tok.pad_token_id; end = tok.convert_tokens_to_ids("<|im_end|>")
train = format_examples(proc, "larger_shape", 2048, 0, labels="true")
val = format_examples(proc, "larger_shape", 128, 1, labels="true")
def layout(batch):
    ks = [e["mask"].index(1) for e in batch]; P = max(ks)
    ids = torch.full((len(batch), P), pad); att = torch.zeros_like(ids)
    for i, (e, k) in enumerate(zip(batch, ks)):
        ids[i, P - k:] = torch.tensor(e["ids"][:k]); att[i, P - k:] = 1
    return ids, att
def logits(batch, ids, att):
    return model(input_ids=ids, attention_mask=att, **vl_inputs(model.config, [e["inputs"] for e in batch], ids, att)).logits.float()
truth = lambda e: tok.decode(e["ids"][e["mask"].index(1):-1])
def evaluate():
    ids, att = layout(val)
    with torch.no_grad():
        z = logits(val, ids, att)[:, -1]
    t = torch.tensor([e["ids"][e["mask"].index(1)] for e in val])
    return round((z.argmax(-1) == t).float().mean().item(), 3), round(torch.softmax(z, -1)[torch.arange(len(val)), t].mean().item(), 3)
opt = torch.optim.AdamW(model.parameters(), lr=lr)
print("step 0", evaluate(), flush=True)
for s in range(1, steps + 1):
    pics = rng.sample(train, 32); batch = [e for e in pics for _ in range(4)]
    ids, att = layout(batch); P = ids.shape[1]
    with torch.no_grad():
        for _ in range(6):
            y = torch.multinomial(torch.softmax(mask_logits(logits(batch, ids, att)[:, -1], never_sampled(model.config)), -1), 1)
            ids = torch.cat([ids, y], 1); att = torch.cat([att, torch.ones_like(y)], 1)
    resp = ids[:, P:]
    done = (resp == end).long().cumsum(1); mask = ((done - (resp == end).long()) == 0).float()  # up to and incl. im_end
    r = torch.tensor([float(tok.decode(resp[i][mask[i].bool()]).startswith(truth(e))) for i, e in enumerate(batch)]).view(32, 4)
    a = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).flatten()
    z = mask_logits(logits(batch, ids, att)[:, P - 1:-1], never_sampled(model.config))
    lp = torch.log_softmax(z, -1).gather(-1, resp[..., None]).squeeze(-1)
    loss = -(a[:, None] * lp * mask).sum() / mask.sum()
    opt.zero_grad(); loss.backward(); opt.step()
    if s % 10 == 0:
        print("step", s, evaluate(), "train_r", round(r.mean().item(), 3), flush=True)
