"""Probe (docs/vlm.md "The VL demo", why GRPO is flat): plain-torch GRPO on the FIRST answer token only
(no plait trainer, actor or loss), or supervised first-token training, from a VL demo model folder.

    python bench/probe_vl_first_token.py <model dir, e.g. $PLAIT_CACHE/tiny-qwen2-vl-demo/warmstart> grpo|sft <steps> <lr>

SEED=<n> picks the batches and samples. Prints greedy first-token accuracy, share answering red, mean p(true).
"""
import sys, random, torch, time
from plait.models import load_causal_lm
from plait.models_vl import load_processor
from plait.vl_demo import format_examples
from plait.models_vl import vl_inputs
M = sys.argv[1]; mode = sys.argv[2]; steps = int(sys.argv[3]); lr = float(sys.argv[4])
import os; S=int(os.environ.get("SEED","0")); torch.manual_seed(S); rng = random.Random(S)
proc = load_processor(M); model = load_causal_lm(M); model.train()
tok = proc.tokenizer; pad = tok.pad_token_id
train = format_examples(proc, "larger_shape", 2048, 0, labels="true")
from plait.data.tasks import make_task_rows
val = format_examples(proc, "larger_shape", 128, 1, labels="true")
r_id, b_id = tok.convert_tokens_to_ids("r"), tok.convert_tokens_to_ids("b")
def first_logits(batch):
    # left-padded prompts, logits at the last prompt position
    ks = [e["mask"].index(1) for e in batch]; P = max(ks)
    ids = torch.full((len(batch), P), pad); att = torch.zeros_like(ids)
    for i, (e, k) in enumerate(zip(batch, ks)):
        ids[i, P - k:] = torch.tensor(e["ids"][:k]); att[i, P - k:] = 1
    extra = vl_inputs(model.config, [e["inputs"] for e in batch], ids, att)
    return model(input_ids=ids, attention_mask=att, **extra).logits[:, -1].float()
def truth(e): return e["ids"][e["mask"].index(1)]
def evaluate():
    with torch.no_grad():
        z = first_logits(val)
    pred = z.argmax(-1); t = torch.tensor([truth(e) for e in val])
    p = torch.softmax(z, -1)
    return (pred == t).float().mean().item(), (pred == r_id).float().mean().item(), p[torch.arange(len(val)), t].mean().item()
opt = torch.optim.AdamW(model.parameters(), lr=lr)
print("step 0 acc/red_frac/p_true", evaluate(), flush=True)
for s in range(1, steps + 1):
    if mode == "sft":
        batch = rng.sample(train, 16)
        z = first_logits(batch); t = torch.tensor([truth(e) for e in batch])
        loss = torch.nn.functional.cross_entropy(z, t)
    else:
        pics = rng.sample(train, 32); batch = [e for e in pics for _ in range(4)]
        z = first_logits(batch); logp = torch.log_softmax(z, -1)
        y = torch.multinomial(logp.exp().detach(), 1).squeeze(1)
        r = (y == torch.tensor([truth(e) for e in batch])).float().view(32, 4)
        a = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).flatten()
        loss = -(a * logp[torch.arange(len(batch)), y]).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if s % 10 == 0:
        print("step", s, "acc/red_frac/p_true", [round(x, 3) for x in evaluate()], "train_r", round(r.mean().item(), 3) if mode != "sft" else "", flush=True)
