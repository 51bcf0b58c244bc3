"""Every ctypes prototype of prototypes.PROTOTYPES against ROCr's declaration of that function.

Two checks: the parameter count and return type read from the headers with a small regex, and a C
file in which each function is assigned to a pointer of the type the ctypes prototype implies, so the
C compiler itself compares every parameter (``-Werror=incompatible-pointer-types``).
"""
from __future__ import annotations

import ast
import inspect
import re
import types as pytypes

import pytest

from abi_support import C_INCLUDES, HAVE_HEADERS, CompileError, compile_c, header_text, header_typedefs
from abi_support import needs_compiler, needs_headers
from aiogpu.hsa_bindings import loader, prototypes
from aiogpu.hsa_bindings import types as T
from aiogpu.hsa_bindings.prototypes import OPTIONAL, PROTOTYPES

pytestmark = pytest.mark.abi

# Prototypes of newer ROCr (>= 5.7) for the optional calls that 5.2.3's headers lack.
NEWER_DECLARATIONS = {
    "hsa_amd_memory_async_copy_on_engine":
        "hsa_status_t HSA_API hsa_amd_memory_async_copy_on_engine(void* dst, hsa_agent_t dst_agent, "
        "const void* src, hsa_agent_t src_agent, size_t size, uint32_t num_dep_signals, "
        "const hsa_signal_t* dep_signals, hsa_signal_t completion_signal, "
        "hsa_amd_sdma_engine_id_t engine_id, bool force_copy_on_sdma);",
    "hsa_amd_memory_copy_engine_status":
        "hsa_status_t HSA_API hsa_amd_memory_copy_engine_status(hsa_agent_t dst_agent, "
        "hsa_agent_t src_agent, uint32_t* engine_ids_mask);",
}
NEWER_TYPEDEFS = {  # newer ROCr lists HSA_AMD_SDMA_ENGINE_0..15 (1 << i); one is enough for the type
    "hsa_amd_sdma_engine_id_t":
        "typedef enum hsa_amd_sdma_engine_id { HSA_AMD_SDMA_ENGINE_0 = 0x1 } hsa_amd_sdma_engine_id_t;",
}

# ---------------------------------------------------------------------------------------------
# the headers' prototypes: name -> (return type, [parameter texts])


def parse_declarations(text: str) -> dict[str, tuple[str, list[str]]]:
    found = {}
    for m in re.finditer(r"(\w+)[\s*]*\bHSA_API\s+(?:HSA_DEPRECATED\s+)?(\w+)\s*\(", text):
        depth, start, params = 1, m.end(), []
        for i in range(m.end(), len(text)):       # split at the top-level commas up to the ')'
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            if depth == 0 or (depth == 1 and text[i] == ","):
                params.append(" ".join(text[start:i].split()))
                start = i + 1
            if depth == 0:
                break
        found[m.group(2)] = (m.group(1), [p for p in params if p not in ("", "void")])
    return found


HEADER_TEXT = header_text() if HAVE_HEADERS else ""
IN_HEADERS = parse_declarations(HEADER_TEXT)
DECLARED = {**parse_declarations(" ".join(NEWER_DECLARATIONS.values())), **IN_HEADERS}

# ---------------------------------------------------------------------------------------------
# the C spelling of a ctypes prototype, read from the source of prototypes.py and types.py, where the
# aliases still carry their C names (at run time hsa_status_t *is* c_int32 and the enum name is gone)


def assignments(module) -> dict[str, ast.expr]:
    """Module-level ``name = expr`` (and ``name: T = expr``) of a module's source."""
    out = {}
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if isinstance(target, ast.Name):
                out[target.id] = node.value
    return out


def called(node) -> str | None:
    """The called function's name for ``f(...)`` or ``mod.f(...)``."""
    if isinstance(node, ast.Call):
        return getattr(node.func, "attr", getattr(node.func, "id", None))
    return None


PROTO_SRC, TYPES_SRC = assignments(prototypes), assignments(T)
TABLE_SRC = {key.value: value for key, value in zip(PROTO_SRC["PROTOTYPES"].keys, PROTO_SRC["PROTOTYPES"].values)}
CALLBACKS = {name: node for name, node in TYPES_SRC.items() if called(node) == "CFUNCTYPE"}
C_SCALARS = {"c_int": "int", "c_bool": "bool", "c_size_t": "size_t", "c_void_p": "void*", "c_char_p": "char*",
             **{f"c_{u}int{n}": f"{u}int{n}_t" for u in ("", "u") for n in (8, 16, 32, 64)}}


def c_type(node: ast.expr) -> str:
    if isinstance(node, ast.Constant) and node.value is None:
        return "void"
    if called(node) == "POINTER":
        return c_type(node.args[0]) + "*"
    name = getattr(node, "attr", getattr(node, "id", None))
    if name in C_SCALARS:
        return C_SCALARS[name]
    if name in CALLBACKS or name.startswith(("hsa_", "amd_")):
        return name                               # a C typedef of the same name (emitted for callbacks)
    return c_type(PROTO_SRC[name])                # a shorthand of prototypes.py (S, V, Q)


def c_signature(call_or_tuple: ast.expr) -> tuple[str, list[str]]:
    """(return type, parameter types) of a PROTOTYPES entry ``(restype, [argtypes])`` or a
    ``CFUNCTYPE(restype, *argtypes)`` call."""
    if isinstance(call_or_tuple, ast.Tuple):
        restype, argtypes = call_or_tuple.elts[0], call_or_tuple.elts[1].elts
    else:
        restype, *argtypes = call_or_tuple.args
    return c_type(restype), [c_type(a) for a in argtypes]


def function_pointer(ret: str, name: str, params: list[str]) -> str:
    return f"{ret} (*{name})({', '.join(params) or 'void'})"


def prototype_program() -> tuple[str, dict[int, str]]:
    """The C file, and which function each of its lines checks."""
    lines = ["#include <stdbool.h>", "#include <stddef.h>", "#include <stdint.h>",
             "#define const /* ctypes cannot say const, and const is no part of the calling convention */",
             *C_INCLUDES.splitlines()]
    typedefs = header_typedefs(HEADER_TEXT)
    lines += [decl for name, decl in NEWER_TYPEDEFS.items() if name not in typedefs]
    lines += [decl for name, decl in NEWER_DECLARATIONS.items() if name not in IN_HEADERS]
    for callback, node in CALLBACKS.items():
        ret, params = c_signature(node)
        lines.append(f"typedef {function_pointer(ret, callback, params)};")
    where = {}
    for name, entry in TABLE_SRC.items():
        ret, params = c_signature(entry)
        lines.append(f"{function_pointer(ret, 'p_' + name, params)} = {name};")
        where[len(lines)] = name                  # 1-based line number of that assignment
    return "\n".join(lines) + "\n", where


# ---------------------------------------------------------------------------------------------


def test_source_reading_matches_runtime_table():
    """The source read above is the table the bindings use (same names, same ctypes objects)."""
    assert list(TABLE_SRC) == list(PROTOTYPES)
    ns_p, ns_t = vars(prototypes), vars(T)
    evaluate = lambda node, ns: eval(compile(ast.Expression(node), "<prototypes>", "eval"), ns)  # noqa: E731
    for name, entry in TABLE_SRC.items():
        restype, argtypes = PROTOTYPES[name]
        assert evaluate(entry.elts[0], ns_p) is restype, name
        assert [evaluate(a, ns_p) for a in entry.elts[1].elts] == list(argtypes), name
    for name, node in CALLBACKS.items():
        assert getattr(T, name)._restype_ is evaluate(node.args[0], ns_t), name
        assert list(getattr(T, name)._argtypes_) == [evaluate(a, ns_t) for a in node.args[1:]], name


@needs_headers
@pytest.mark.parametrize("name", list(PROTOTYPES))
def test_argument_count_and_return_type(name):
    restype, argtypes = PROTOTYPES[name]
    assert name in DECLARED, f"{name} is declared neither by ROCr's headers nor in NEWER_DECLARATIONS"
    header_ret, header_params = DECLARED[name]
    source = "header" if name in IN_HEADERS else "newer ROCr"
    assert len(argtypes) == len(header_params), \
        f"{name}: ctypes has {len(argtypes)} arguments, the {source} declares {len(header_params)}: {header_params}"
    assert c_signature(TABLE_SRC[name])[0] == header_ret, f"{name}: return type differs from the {source}'s"


@needs_headers
def test_optional_names_are_exactly_the_ones_old_headers_may_lack():
    assert OPTIONAL <= set(PROTOTYPES)
    assert set(PROTOTYPES) - OPTIONAL <= set(IN_HEADERS), "a REQUIRED function that ROCr 5.2.3 does not declare"


@pytest.fixture(scope="module")
def compiler_verdict(abi_workdir) -> dict[str, str]:
    """{function: the compiler's complaints} from compiling the pointer assignments once."""
    source, where = prototype_program()
    try:
        warnings = compile_c(source, abi_workdir, "prototypes", run=False)
    except CompileError as exc:
        warnings = exc.stderr
    verdict = {}
    for m in re.finditer(r"prototypes\.c:(\d+):\d+: (?:error|warning): (.*)", warnings):
        verdict.setdefault(where.get(int(m.group(1)), "<elsewhere>"), []).append(m.group(2))
    return {name: "\n".join(msgs) for name, msgs in verdict.items()}


@needs_headers
@needs_compiler
def test_generated_c_compiles_cleanly(compiler_verdict):
    if "<elsewhere>" in compiler_verdict:
        pytest.fail(f"the generated C file does not compile:\n{compiler_verdict['<elsewhere>']}", pytrace=False)


@needs_headers
@needs_compiler
@pytest.mark.parametrize("name", list(PROTOTYPES))
def test_c_compiler_accepts_prototype(compiler_verdict, name):
    if name in compiler_verdict:
        ret, params = c_signature(TABLE_SRC[name])
        pytest.fail(f"{function_pointer(ret, name, params)} does not match ROCr's declaration:\n"
                    f"{compiler_verdict[name]}", pytrace=False)


def test_bind_python_types_every_function():
    """The emulator side of the loader: every bound function carries the prototype's types, and an
    absent optional one is reported missing."""
    impl = pytypes.SimpleNamespace(**{name: (lambda *args: 0) for name in PROTOTYPES
                                      if name != "hsa_amd_memory_copy_engine_status"})
    funcs, keep, missing = loader.bind_python(impl)
    assert missing == ("hsa_amd_memory_copy_engine_status",)
    for name, fn in funcs.items():
        restype, argtypes = PROTOTYPES[name]
        assert fn.restype is restype and list(fn.argtypes) == list(argtypes), name
