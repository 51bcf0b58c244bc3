"""The real ROCr library (``libhsa-runtime64.so.1``) through the bindings and the loader.

Every library call runs in a fresh interpreter (abi_support.run_python): a crash in ROCr cannot take
pytest down, and hsa_init's process-wide state does not leak from one test into the next.
"""
from __future__ import annotations

import json

import pytest

from abi_support import LIBRARY, header_text, needs_headers, needs_library, needs_no_gpu, run_python
from aiogpu.hsa_bindings.prototypes import OPTIONAL, PROTOTYPES

pytestmark = [pytest.mark.abi, needs_library]

HSA_STATUS_ERROR_OUT_OF_RESOURCES = 0x1008

# Runs first in every subprocess: the library opened the loader's way, typed by bind_library.
PRELUDE = f"""
import ctypes, json
import aiogpu
from aiogpu.hsa_bindings import loader, prototypes, types as T
lib = ctypes.CDLL({str(LIBRARY)!r}, mode=ctypes.RTLD_GLOBAL)
def out(**result): print(json.dumps(result))
"""


def in_subprocess(body: str) -> dict:
    return run_python(PRELUDE + body)


def test_symbols_resolve_and_bind_library_reports_the_absent_optional_ones():
    got = in_subprocess("""
funcs, missing = loader.bind_library(lib)
out(required_absent=[n for n in prototypes.REQUIRED if not hasattr(lib, n)],
    optional_present={n: hasattr(lib, n) for n in sorted(prototypes.OPTIONAL)},
    bound=sorted(funcs), missing=list(missing))
""")
    assert got["required_absent"] == [], f"{LIBRARY} lacks required symbols: {got['required_absent']}"
    print("optional symbols present in", LIBRARY, ":", json.dumps(got["optional_present"]))
    absent = [n for n in PROTOTYPES if n in OPTIONAL and not got["optional_present"][n]]
    assert got["missing"] == absent, "bind_library's 'missing' must be exactly the absent optional symbols"
    assert sorted(set(PROTOTYPES) - set(absent)) == got["bound"]


@needs_headers
def test_optional_symbols_present_exactly_when_the_headers_declare_them():
    """ROCr 5.2.3 lacks the SDMA-engine calls in both its headers and its library; a newer pair has both."""
    got = in_subprocess(f"out(present={{n: hasattr(lib, n) for n in {sorted(OPTIONAL)!r}}})")
    declared = header_text()
    for name, present in got["present"].items():
        assert present == (f" {name}(" in declared or f" {name} (" in declared), \
            f"{name}: library has it = {present}, but the headers disagree"


def test_bound_functions_carry_argtypes_and_restype():
    got = in_subprocess("""
funcs, _ = loader.bind_library(lib)
wrong = [n for n, fn in funcs.items()
         if fn.restype is not prototypes.PROTOTYPES[n][0] or list(fn.argtypes) != list(prototypes.PROTOTYPES[n][1])]
out(wrong=wrong, count=len(funcs))
""")
    assert got["wrong"] == [], f"bound without the prototype's types: {got['wrong']}"
    assert got["count"] >= len(PROTOTYPES) - len(OPTIONAL)


@needs_no_gpu
def test_hsa_init_fails_out_of_resources_and_status_string_still_works():
    got = in_subprocess("""
funcs, _ = loader.bind_library(lib)
init = funcs["hsa_init"]()
text = ctypes.c_char_p()
string_status = funcs["hsa_status_string"](init, ctypes.byref(text))
out(init=init, string_status=string_status, text=(text.value or b"").decode(),
    shut_down=funcs["hsa_shut_down"]())
""")
    assert got["init"] == HSA_STATUS_ERROR_OUT_OF_RESOURCES, f"hsa_init returned {got['init']:#x}"
    # ROCr answers hsa_status_string without an initialised runtime.
    assert got["string_status"] == 0, f"hsa_status_string after a failed init returned {got['string_status']:#x}"
    assert got["text"].startswith("HSA_STATUS_ERROR_OUT_OF_RESOURCES"), got["text"]
    # A failed hsa_init leaves nothing open: shutting down answers NOT_INITIALIZED.
    assert got["shut_down"] == 0x100B, f"hsa_shut_down after a failed init returned {got['shut_down']:#x}"


@needs_no_gpu
def test_try_real_gives_the_status_as_reason():
    got = in_subprocess("api, why = loader.try_real(); out(api=api is not None, why=why)")
    assert got["api"] is False
    assert "0x1008" in got["why"] and "HSA_STATUS_ERROR_OUT_OF_RESOURCES" in got["why"], got["why"]


@needs_no_gpu
def test_auto_choice_falls_back_to_the_emulator_with_the_reason():
    """With ROCr installed but no GPU (hsa_init: 0x1008), auto-selection picks the emulator and
    says why (CUDA is left out: the emulator is what answers after both)."""
    got = in_subprocess("""
from aiogpu.runtime import backend_class, choose_backend
ok, why_hsa = backend_class("hsa").probe()
name, reason = choose_backend(None)
rt = aiogpu.Runtime("emulator") if name == "emulator" else None
out(ok=ok, backend=name, reason=reason, rt_backend=rt.backend if rt else None)
rt and rt.close()
""")
    assert got["ok"] is False
    assert got["backend"] in ("emulator", "cuda"), got
    assert "0x1008" in got["reason"], got["reason"]
    if got["backend"] == "emulator":
        assert "emulator" in got["reason"] and got["rt_backend"] == "emulator", got


@needs_no_gpu
def test_load_hsa_raises_backend_unavailable():
    got = in_subprocess("""
try:
    api = loader.load("hsa")
except aiogpu.BackendUnavailable as exc:
    out(raised=True, message=str(exc))
else:
    out(raised=False, backend=api.backend)
""")
    assert got["raised"], f"load('hsa') returned a {got.get('backend')} API instead of raising"
    message = got["message"]
    assert "hsa" in message and "0x1008" in message and "HSA_STATUS_ERROR_OUT_OF_RESOURCES" in message, message
