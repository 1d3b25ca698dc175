"""The globals policy: which globals a pickle may name, and the verdict on each one. No torch import.

:data:`WEIGHTS_ONLY_ALLOWED` lists the globals ``torch.load(weights_only=True)`` accepts by default;
:func:`classify_global` gives every global named in a pickle a verdict (:data:`ALLOWED`, :data:`DANGEROUS` with
what the gadget can do, or :data:`UNKNOWN`), used by ``ckptool scan`` and ``ckptool inspect``;
:func:`refusal_remedy` says what to do about a file ``torch.load(weights_only=True)`` refuses.

:data:`WEIGHTS_ONLY_ALLOWED` is generated from ``torch._weights_only_unpickler._get_allowed_globals()`` of torch
2.13.0 (the keys of that dict, ``module.qualname``). A checkpoint whose pickle names only these (plus the opcodes
torch's restricted unpickler handles itself) loads with ``weights_only=True``; anything else needs the user's trust
(``weights_only=False``) or ``torch.serialization.add_safe_globals``. Regenerate with
``python -c "from torch import _weights_only_unpickler as w; print(sorted(w._get_allowed_globals()))"``.
"""

from __future__ import annotations

from collections.abc import Iterable

WEIGHTS_ONLY_ALLOWED: frozenset[str] = frozenset(
    [
        '_codecs.encode',
        'builtins.bytearray',
        'builtins.complex',
        'builtins.set',
        'collections.Counter',
        'collections.OrderedDict',
        'torch.BFloat16Storage',
        'torch.BFloat16Tensor',
        'torch.BoolStorage',
        'torch.BoolTensor',
        'torch.ByteStorage',
        'torch.ByteTensor',
        'torch.CharStorage',
        'torch.CharTensor',
        'torch.ComplexDoubleStorage',
        'torch.ComplexFloatStorage',
        'torch.DoubleStorage',
        'torch.DoubleTensor',
        'torch.FloatStorage',
        'torch.FloatTensor',
        'torch.HalfStorage',
        'torch.HalfTensor',
        'torch.IntStorage',
        'torch.IntTensor',
        'torch.LongStorage',
        'torch.LongTensor',
        'torch.QInt32Storage',
        'torch.QInt8Storage',
        'torch.QUInt2x4Storage',
        'torch.QUInt4x2Storage',
        'torch.QUInt8Storage',
        'torch.ShortStorage',
        'torch.ShortTensor',
        'torch.Size',
        'torch.Tensor',
        'torch._tensor._rebuild_from_type_v2',
        'torch._utils._rebuild_device_tensor_from_cpu_tensor',
        'torch._utils._rebuild_device_tensor_from_numpy',
        'torch._utils._rebuild_meta_tensor_no_storage',
        'torch._utils._rebuild_nested_tensor',
        'torch._utils._rebuild_parameter',
        'torch._utils._rebuild_parameter_with_state',
        'torch._utils._rebuild_qtensor',
        'torch._utils._rebuild_sparse_tensor',
        'torch._utils._rebuild_tensor',
        'torch._utils._rebuild_tensor_v2',
        'torch._utils._rebuild_tensor_v3',
        'torch._utils._rebuild_wrapper_subclass',
        'torch.bfloat16',
        'torch.bits16',
        'torch.bits1x8',
        'torch.bits2x4',
        'torch.bits4x2',
        'torch.bits8',
        'torch.bool',
        'torch.complex128',
        'torch.complex32',
        'torch.complex64',
        'torch.cuda.BFloat16Storage',
        'torch.cuda.BFloat16Tensor',
        'torch.cuda.BoolStorage',
        'torch.cuda.BoolTensor',
        'torch.cuda.ByteStorage',
        'torch.cuda.ByteTensor',
        'torch.cuda.CharStorage',
        'torch.cuda.CharTensor',
        'torch.cuda.ComplexDoubleStorage',
        'torch.cuda.ComplexFloatStorage',
        'torch.cuda.DoubleStorage',
        'torch.cuda.DoubleTensor',
        'torch.cuda.FloatStorage',
        'torch.cuda.FloatTensor',
        'torch.cuda.HalfStorage',
        'torch.cuda.HalfTensor',
        'torch.cuda.IntStorage',
        'torch.cuda.IntTensor',
        'torch.cuda.LongStorage',
        'torch.cuda.LongTensor',
        'torch.cuda.ShortStorage',
        'torch.cuda.ShortTensor',
        'torch.cuda.sparse.BFloat16Tensor',
        'torch.cuda.sparse.ByteTensor',
        'torch.cuda.sparse.CharTensor',
        'torch.cuda.sparse.DoubleTensor',
        'torch.cuda.sparse.FloatTensor',
        'torch.cuda.sparse.HalfTensor',
        'torch.cuda.sparse.IntTensor',
        'torch.cuda.sparse.LongTensor',
        'torch.cuda.sparse.ShortTensor',
        'torch.device',
        'torch.float16',
        'torch.float32',
        'torch.float4_e2m1fn_x2',
        'torch.float64',
        'torch.float8_e4m3fn',
        'torch.float8_e4m3fnuz',
        'torch.float8_e5m2',
        'torch.float8_e5m2fnuz',
        'torch.float8_e8m0fnu',
        'torch.int1',
        'torch.int16',
        'torch.int2',
        'torch.int3',
        'torch.int32',
        'torch.int4',
        'torch.int5',
        'torch.int6',
        'torch.int64',
        'torch.int7',
        'torch.int8',
        'torch.nn.parameter.Parameter',
        'torch.per_channel_affine',
        'torch.per_channel_affine_float_qparams',
        'torch.per_channel_symmetric',
        'torch.per_tensor_affine',
        'torch.per_tensor_symmetric',
        'torch.qint32',
        'torch.qint8',
        'torch.quint2x4',
        'torch.quint4x2',
        'torch.quint8',
        'torch.serialization._get_layout',
        'torch.sparse.BFloat16Tensor',
        'torch.sparse.ByteTensor',
        'torch.sparse.CharTensor',
        'torch.sparse.DoubleTensor',
        'torch.sparse.FloatTensor',
        'torch.sparse.HalfTensor',
        'torch.sparse.IntTensor',
        'torch.sparse.LongTensor',
        'torch.sparse.ShortTensor',
        'torch.storage.TypedStorage',
        'torch.storage.UntypedStorage',
        'torch.uint1',
        'torch.uint16',
        'torch.uint2',
        'torch.uint3',
        'torch.uint32',
        'torch.uint4',
        'torch.uint5',
        'torch.uint6',
        'torch.uint64',
        'torch.uint7',
        'torch.uint8',
    ]
)


def is_allowed(qualified_name: str) -> bool:
    """True when ``torch.load(weights_only=True)`` accepts the global ``module.qualname`` (Python 3 names)."""
    return qualified_name in WEIGHTS_ONLY_ALLOWED


# ------------------------------------------------------------------------------------------------ verdicts
#: the verdicts of :func:`classify_global`
ALLOWED, DANGEROUS, UNKNOWN = "allowed", "dangerous", "unknown"

#: modules whose every callable is a gadget (the module and its submodules): what each one can do
DANGEROUS_MODULES: dict[str, str] = {
    "os": "runs processes and changes files", "posix": "runs processes and changes files",
    "nt": "runs processes and changes files", "subprocess": "runs processes", "pty": "runs processes",
    "popen2": "runs processes", "commands": "runs processes", "multiprocessing": "runs processes",
    "asyncio": "runs processes and opens connections", "socket": "opens network connections",
    "_socket": "opens network connections", "ssl": "opens network connections",
    "http": "opens network connections", "urllib": "opens network connections", "urllib2": "opens network connections",
    "requests": "opens network connections", "httplib": "opens network connections",
    "ftplib": "opens network connections", "smtplib": "opens network connections",
    "telnetlib": "opens network connections", "webbrowser": "opens URLs",
    "importlib": "imports any module", "pkgutil": "imports any module", "imp": "imports any module",
    "runpy": "runs Python files and modules", "code": "runs Python code", "codeop": "compiles Python code",
    "pydoc": "imports any module (pydoc.locate)", "ctypes": "calls C functions", "_ctypes": "calls C functions",
    "cffi": "calls C functions", "shutil": "copies and deletes files", "tempfile": "creates files",
    "pickle": "unpickles more data (running it)", "_pickle": "unpickles more data (running it)",
    "cPickle": "unpickles more data (running it)", "dill": "unpickles more data (running it)",
    "cloudpickle": "unpickles more data (running it)", "joblib": "unpickles more data (running it)",
    "marshal": "loads code objects", "shelve": "unpickles more data (running it)",
    "timeit": "runs Python code", "cProfile": "runs Python code", "profile": "runs Python code",
    "trace": "runs Python code", "pdb": "runs Python code", "bdb": "runs Python code",
    "doctest": "runs Python code", "sys": "changes the interpreter (sys.modules, hooks)",
    "signal": "changes signal handlers",
    "io": "opens files", "_io": "opens files", "codecs": "opens files (codecs.open)",
    "fileinput": "opens files", "glob": "lists files", "pathlib": "reads and writes files",
    "zipimport": "imports code from archives", "venv": "creates environments and runs pip",
    "ensurepip": "runs pip", "pip": "installs packages", "setuptools": "runs build code",
    "distutils": "runs build code", "gc": "reaches every live object (gc.get_objects)",
    "inspect": "reaches frames and source", "types": "builds functions and code objects",
}

#: single names that are gadgets
DANGEROUS_NAMES: dict[str, str] = {
    "builtins.eval": "evaluates Python code", "builtins.exec": "runs Python code",
    "builtins.compile": "compiles Python code", "builtins.__import__": "imports any module",
    "builtins.getattr": "reaches any attribute (getattr(os, 'system'))", "builtins.setattr": "changes any attribute",
    "builtins.delattr": "deletes any attribute", "builtins.open": "opens files", "builtins.input": "reads the console",
    "builtins.breakpoint": "starts a debugger", "builtins.globals": "reaches module globals",
    "builtins.locals": "reaches local variables", "builtins.vars": "reaches namespaces",
    "builtins.help": "starts pydoc", "builtins.exit": "exits the process", "builtins.quit": "exits the process",
    "builtins.memoryview": "reads raw memory",
    "builtins.type": "creates classes", "builtins.super": "reaches parent-class methods",
    "functools.partial": "binds arguments to any callable", "functools.reduce": "calls any callable repeatedly",
    "functools.partialmethod": "binds arguments to any callable",
    "operator.attrgetter": "reaches any attribute", "operator.methodcaller": "calls any method",
    "pkgutil.resolve_name": "imports any module", "pydoc.locate": "imports any module",
    "torch.load": "loads another checkpoint, possibly with weights_only=False",
    "torch.serialization.load": "loads another checkpoint, possibly with weights_only=False",
    "torch.jit.load": "loads TorchScript code", "torch.hub.load": "downloads and runs code",
    "torch.hub.load_state_dict_from_url": "downloads files",
    "torch.utils.cpp_extension.load": "compiles and loads C++ code",
    "torch.utils.cpp_extension.load_inline": "compiles and loads C++ code",
    "torch._inductor.codecache.compile_file": "compiles code",
    "torch.storage._load_from_bytes": "unpickles more data (running it)",
    "numpy.load": "unpickles .npy data with allow_pickle", "numpy.testing._private.utils.runstring": "runs Python code",
    "numpy.lib.npyio.load": "unpickles .npy data with allow_pickle",
}

#: names TorchScript's C++ unpickler resolves itself (torch/csrc/jit/serialization/unpickler.cpp), never importing
TORCHSCRIPT_NAMES = frozenset({
    "torch.jit._pickle.build_intlist", "torch.jit._pickle.build_tensorlist", "torch.jit._pickle.build_doublelist",
    "torch.jit._pickle.build_boollist", "torch.jit._pickle.build_tensor_from_id", "torch.jit._pickle.restore_type_tag",
})


def classify_global(name: str, *, torchscript: bool = False) -> tuple[str, str]:
    """``(status, reason)`` of the global ``module.qualname`` (Python 3 module names).

    ``status`` is :data:`ALLOWED` (in the ``torch.load(weights_only=True)`` allowlist, or resolved by TorchScript's
    own unpickler when ``torchscript`` is true), :data:`DANGEROUS` (a known gadget; ``reason`` says what it can
    do) or :data:`UNKNOWN` (anything else: loading would import and call it).
    """
    if is_allowed(name):
        return ALLOWED, "accepted by torch.load(weights_only=True)"
    if torchscript and (name.startswith("__torch__.") or name in TORCHSCRIPT_NAMES):
        return ALLOWED, "resolved by torch.jit.load's own unpickler, not imported"
    why = DANGEROUS_NAMES.get(name)
    if why is None:
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):
            why = DANGEROUS_MODULES.get(".".join(parts[:i]))
            if why is not None:
                break
    if why is not None:
        return DANGEROUS, why
    return UNKNOWN, "not in torch's weights_only allowlist: loading would import and call it"


def refusal_remedy(path: str, names: Iterable[str]) -> str:
    """What to do about ``path``, whose pickle names ``names`` (``module.qualname``) outside the weights_only
    allowlist: ``ckptool sanitize`` first (it converts numpy arrays and scalars, ``argparse.Namespace`` and other
    plain records, pickled modules, without running anything; what it cannot convert it names with its key path),
    trusting the file second. When a name is :data:`DANGEROUS` the advice is to scan it and not to trust it.
    One or two sentences, starting with a capital."""
    dangerous = [n for n in names if classify_global(n)[0] == DANGEROUS]
    if dangerous:
        return (f"It names {', '.join(dangerous[:3])}, which can run code on your machine: do not load it with "
                f"trust; see `ckptool scan {path}`")
    return (f"Convert it without running it: `ckptool sanitize {path} -o OUT.pth` (numpy arrays become tensors, "
            "argparse.Namespace records dicts, a pickled model its state_dict); or pass trust=True (--trust) only "
            "if you trust its source")
