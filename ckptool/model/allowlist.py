"""The globals policy: which globals a pickle may name, and the verdict on each one. No torch import.

:data:`WEIGHTS_ONLY_ALLOWED` lists the globals ``torch.load(weights_only=True)`` accepts by default;
:func:`classify_global` gives every global named in a pickle a status (:data:`ALLOWED`, :data:`NEEDS_TRUST`,
:data:`UNKNOWN` or :data:`DANGEROUS`, with the reason), and :func:`level_of` / :func:`worst_level` turn statuses into
the three levels of ``ckptool scan`` (:data:`SAFE`, :data:`NEEDS_TRUST`, :data:`DANGEROUS`), used by ``ckptool scan``
and ``ckptool inspect``; :func:`refusal_remedy` says what to do about a file ``torch.load(weights_only=True)`` refuses.

:data:`WEIGHTS_ONLY_ALLOWED` (kept, with how to regenerate it, in :mod:`ckptool.model.weights_only`) holds the
keys of ``torch._weights_only_unpickler._get_allowed_globals()`` of torch 2.13.0 (``module.qualname``). A checkpoint
whose pickle names only these (plus the opcodes torch's restricted unpickler handles itself) loads with
``weights_only=True``; anything else needs the user's trust (``weights_only=False``) or
``torch.serialization.add_safe_globals``.

The three levels, and the rule that puts each global in one (first match wins):

1. ``safe`` (status ``allowed``): in :data:`WEIGHTS_ONLY_ALLOWED`; in a TorchScript archive also the names its C++
   unpickler resolves itself (``__torch__.*``, :data:`TORCHSCRIPT_NAMES`); in a torch.distributed.checkpoint
   ``.metadata`` pickle also DCP's own record classes and ``pathlib`` paths (:data:`DCP_GLOBALS`): DCP's reader
   rebuilds them as data, and these names can call nothing else. Anywhere else they need trust (rule 2).
2. ``needs-trust`` (status ``needs-trust``): a name on :data:`NEEDS_TRUST_NAMES` (exact), such as
   ``argparse.Namespace``, ``pathlib.PosixPath``, numpy's array/dtype/RNG-state rebuilders, ``torch._C.Generator``
   or the DCP metadata classes (:data:`DCP_GLOBALS`). This list is checked before rule 4, so
   that ``pathlib.PosixPath`` is data while every other ``pathlib`` name stays dangerous. A name on
   :data:`DANGEROUS_NAMES` (exact) is dangerous. The rules below apply to every other name.
3. ``needs-trust``: a class (last part CapWords, every part before it a lowercase module name) of a module of
   :data:`NEEDS_TRUST_MODULES` (exactly that module: ``torch.nn.modules.linear``, ``torch.optim.adam``,
   ``numpy.random.mtrand``...): library classes that carry state and run no code of the file's choosing when
   rebuilt.
4. ``dangerous``: anything in a module of :data:`DANGEROUS_MODULES` (process, file, network, import, eval...).
5. ``dangerous``: any other function or attribute (``operator.add``, ``mypkg.utils.run``,
   ``pathlib.Path.write_text``): loading would call it with arguments the file chooses, and no list shows it
   harmless; and any other class of the standard library or numpy (:data:`KNOWN_PACKAGES`: ``_pyio.FileIO``,
   ``_multiprocessing.SemLock``, ``sqlite3.Connection``): they are installed wherever the file is loaded, so
   trusting "the package" decides nothing, and their constructors open files, sockets, processes and databases.
6. ``needs-trust`` (status ``unknown``): any other class (``mypkg.models.Net``). Nothing shows it
   harmless: loading imports its module (running that module's top-level code) and calls the class or its
   ``__setstate__`` with data from the file; a class-shaped name can even be an alias of a function. Load it only
   if you trust both the file and the package.

A dotted name is the object it reaches, not the module it starts in (:func:`classify_global`): a name rules 3 and
6 would rate is also rated as each shorter name that starts at a part naming a top-level module
(:data:`REEXPORTABLE`), past the modules the lists show are real, and is dangerous when a list makes that shorter
name dangerous: ``torch.utils.cpp_extension.subprocess.Popen`` is ``subprocess.Popen`` and
``torch.optim.lr_scheduler.types.CodeType`` is ``types.CodeType``, both dangerous (``mypkg.token.Tokenizer`` stays
an unknown class: ``token.Tokenizer`` is on no list).
Python 2 names (``__builtin__.long``) are rated as the Python 3 names ``pickle`` maps them to
(:func:`ckptool.formats.nodes.qualified_name`, through the standard library's ``_compat_pickle`` tables).

Whole files are recognised by their content (:func:`recognise_file`: accelerate's RNG state), never by their name,
to say what a needs-trust file is. Names are rated by what they are, never by the file name or by how often they
appear; the lists only add ``needs-trust`` names and reasons: the default for a name on no list is at least
``needs-trust``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable

from ckptool.formats.nodes import ALLOC, CLASS_BUILD, USE_MARK, split_use
from ckptool.formats.unpickler import MAX_REQUEST_BYTES
from ckptool.model.weights_only import WEIGHTS_ONLY_ALLOWED

#: globals a DCP ``.metadata`` pickle names (torch/distributed/checkpoint/metadata.py, filesystem.py; read by
#: :mod:`ckptool.formats.dcp`)
DCP_GLOBALS = frozenset({
    *(f"torch.distributed.checkpoint.metadata.{n}" for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    # StorageMeta.checkpoint_id: the folder as a path object (Python 3.13 pickles name pathlib._local)
    *(f"pathlib.{sub}{n}" for sub in ("", "_local.") for n in (
        "Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")),
})


def is_allowed(qualified_name: str) -> bool:
    """True when ``torch.load(weights_only=True)`` accepts the global ``module.qualname`` (Python 3 names). For a
    use of a global (:func:`ckptool.formats.nodes.use_key`): a call over the allocation limit is accepted when its
    global is (torch checks no size), a BUILD on a class never is (torch builds only instances of allowed types).
    A gate before ``torch.load`` asks :func:`classify_global` for :data:`ALLOWED` instead, which refuses both."""
    base, use = split_use(qualified_name)
    if use is not None:
        return use.startswith(ALLOC) and base in WEIGHTS_ONLY_ALLOWED
    return qualified_name in WEIGHTS_ONLY_ALLOWED


# ------------------------------------------------------------------------------------------------ verdicts
#: the statuses of :func:`classify_global` (``NEEDS_TRUST`` and ``DANGEROUS`` are levels too)
ALLOWED, NEEDS_TRUST, UNKNOWN, DANGEROUS = "allowed", "needs-trust", "unknown", "dangerous"
#: the levels of ``ckptool scan``, from best to worst (:func:`level_of`)
SAFE = "safe"
LEVELS: tuple[str, str, str] = (SAFE, NEEDS_TRUST, DANGEROUS)
_LEVEL_OF_STATUS = {ALLOWED: SAFE, NEEDS_TRUST: NEEDS_TRUST, UNKNOWN: NEEDS_TRUST, DANGEROUS: DANGEROUS}


def level_of(status: str) -> str:
    """The scan level (:data:`SAFE`, :data:`NEEDS_TRUST` or :data:`DANGEROUS`) of a :func:`classify_global` status:
    ``allowed`` is safe, ``needs-trust`` and ``unknown`` (an unknown class) need trust, ``dangerous`` is dangerous.

    Raises:
        KeyError: ``status`` is not one of :data:`ALLOWED`, :data:`NEEDS_TRUST`, :data:`UNKNOWN`, :data:`DANGEROUS`.
    """
    return _LEVEL_OF_STATUS[status]


def level_word(level: str, reason: str = "") -> str:
    """A level as ``ckptool scan`` prints it (``inspect``, ``sanitize`` and the hints print the same words): ``safe``,
    ``needs-trust``, ``DANGEROUS``; a dangerous level with ``: reason`` when ``reason`` is given."""
    if level != DANGEROUS:
        return level
    return f"DANGEROUS: {reason}" if reason else "DANGEROUS"


def worst_level(statuses: Iterable[str]) -> str:
    """The worst level among ``statuses`` (:func:`classify_global` statuses); :data:`SAFE` when there are none."""
    return max((level_of(s) for s in statuses), key=LEVELS.index, default=SAFE)


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
    "logging": "opens files and connections (FileHandler, SocketHandler)", "zipfile": "creates and overwrites files",
    "tarfile": "creates and overwrites files", "gzip": "opens files", "bz2": "opens files", "lzma": "opens files",
    "sqlite3": "opens database files", "dbm": "opens database files", "mailbox": "creates files",
    "wave": "opens files", "aifc": "opens files", "sunau": "opens files", "mmap": "maps files into memory",
    "socketserver": "opens network servers", "xmlrpc": "opens network connections",
    "imaplib": "opens network connections", "poplib": "opens network connections",
    "nntplib": "opens network connections", "threading": "starts threads running any callable",
    "_thread": "starts threads running any callable", "concurrent": "runs callables in threads and processes",
    "atexit": "registers callables to run at exit", "weakref": "registers callables (weakref.finalize)",
    "torch.utils.tensorboard": "creates log files", "tensorboardX": "creates log files",
    "torch.multiprocessing": "runs processes", "torch.distributed.run": "runs processes",
    "_pyio": "opens files (_pyio.FileIO)", "_multiprocessing": "creates semaphores and processes (SemLock)",
    "_posixsubprocess": "runs processes", "_posixshmem": "creates shared memory", "_sqlite3": "opens database files",
    "_winapi": "runs processes and opens files", "msvcrt": "changes files and the console",
    "winreg": "changes the Windows registry", "_winreg": "changes the Windows registry", "fcntl": "changes files",
    "termios": "changes the terminal", "resource": "changes process limits", "select": "waits on files and sockets",
    "selectors": "waits on files and sockets", "faulthandler": "writes to files", "platform": "runs processes",
    "tkinter": "opens windows", "_tkinter": "opens windows", "turtle": "opens windows",
    "curses": "changes the terminal",
    "mailcap": "runs commands", "xml": "parses files and fetches external entities",
    "torch.utils.cpp_extension": "compiles and runs C++ code and processes (it imports subprocess)",
    "torch.package": "imports code from package archives", "torch.fx": "generates and runs Python code",
    "torch.jit": "loads and compiles TorchScript code", "torch.hub": "downloads and runs code",
    "torch._inductor": "compiles and runs code", "torch._dynamo": "compiles and runs code",
    "torch.utils.benchmark": "runs code and processes",
    "torch.distributed": "opens network stores and process groups (TCPStore, FileStore, RPC)",
    "torch._C._distributed_c10d": "opens network stores and process groups (TCPStore, FileStore)",
    "torch._C._distributed_rpc": "opens network connections",
    "numpy.lib._datasource": "creates and deletes folders (DataSource's destructor runs shutil.rmtree)",
    "numpy.lib.npyio": "reads and writes files (and its DataSource deletes folders)",
    "numpy.f2py": "compiles and runs code", "numpy.distutils": "runs build code", "numpy.testing": "runs Python code",
    "numpy.ctypeslib": "loads C libraries",
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
    **{f"numpy.{m}DataSource": "creates and deletes folders (its destructor runs shutil.rmtree on a path the file "
                              "can set)" for m in ("", "lib.")},
}

_NUMPY_ARRAY = "rebuilds a numpy array, scalar or dtype from its bytes"
_NUMPY_RNG = "rebuilds a numpy random generator from its saved state (accelerate's random_states_*.pkl)"
_PATH = "a file system path as plain data: building it reads and writes nothing (other pathlib names stay dangerous)"
_BUILTIN_TYPE = "a built-in type: builds a value from the file's data, runs nothing"

#: exact names that need trust but run no code of the file's choosing: what each one does when loaded
NEEDS_TRUST_NAMES: dict[str, str] = {
    **{f"numpy.{core}.multiarray.{n}": _NUMPY_ARRAY for core in ("core", "_core") for n in ("_reconstruct", "scalar")},
    **{f"numpy.{core}.numeric._frombuffer": _NUMPY_ARRAY for core in ("core", "_core")},  # protocol 5 arrays
    "numpy.ndarray": _NUMPY_ARRAY, "numpy.dtype": _NUMPY_ARRAY,
    # joblib.dump's array records: joblib.load's NumpyUnpickler reads the raw array bytes that follow the record
    # (an object array's through pickle, whose globals are rated where they stand)
    **{f"joblib.numpy_pickle{m}.{n}": "joblib's numpy array record: joblib.load reads the array's bytes after it"
       for m, n in (("", "NumpyArrayWrapper"), ("_compat", "NDArrayWrapper"), ("_compat", "ZNDArrayWrapper"))},
    **{f"numpy.{t}": "a numpy scalar type: builds a number from the file's data" for t in (
        "bool", "bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "intc", "uintc",
        "intp", "uintp", "int_", "uint", "longlong", "ulonglong", "byte", "ubyte", "short", "ushort", "half",
        "single", "double", "longdouble", "float16", "float32", "float64", "float128", "complex64", "complex128",
        "complex256", "csingle", "cdouble", "clongdouble", "str_", "bytes_", "void", "datetime64", "timedelta64",
        "object_")},
    **{f"numpy.random._pickle.{n}": _NUMPY_RNG
       for n in ("__randomstate_ctor", "__generator_ctor", "__bit_generator_ctor")},
    "numpy.random.bit_generator.__pyx_unpickle_SeedSequence": _NUMPY_RNG,
    "argparse.Namespace": "a record of attributes (training arguments): builds a namespace, runs nothing",
    "types.SimpleNamespace": "a record of attributes: builds a namespace, runs nothing",
    **{f"pathlib.{sub}{n}": _PATH for sub in ("", "_local.") for n in (
        "Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")},
    **{f"builtins.{n}": _BUILTIN_TYPE for n in ("object", "dict", "list", "tuple", "str", "bytes", "int", "float",
                                                "bool", "frozenset", "slice", "range")},
    "collections.defaultdict": "a dict with a default factory (stored, not called, when loaded)",
    "collections.deque": "a queue of values: builds it, runs nothing",
    "copyreg._reconstructor": "builds an object of a class named elsewhere in the pickle (rated on its own)",
    **{f"datetime.{n}": "a date or time value: builds it, runs nothing"
       for n in ("datetime", "date", "time", "timedelta", "timezone")},
    "torch._C.Generator": "a torch random generator: restores its saved RNG state",
    "random.Random": "Python's random generator: restores its saved state, runs nothing",
    # torch.distributed.tensor and device_mesh register these with add_safe_globals when imported (what a torch.save
    # of a DTensor names; DeviceMesh's layouts, registered by `import torch` itself, are in WEIGHTS_ONLY_ALLOWED):
    # the rest of torch.distributed stays dangerous
    **dict.fromkeys((
        "torch.distributed.device_mesh.DeviceMesh", "torch.distributed.tensor._dtensor_spec.DTensorSpec",
        "torch.distributed.tensor._dtensor_spec.TensorMeta", "torch.distributed.tensor._dtensor_spec.ShardOrderEntry",
        "torch.distributed.tensor.DTensor", "torch.distributed.tensor.placement_types.Partial",
        "torch.distributed.tensor.placement_types.Replicate", "torch.distributed.tensor.placement_types.Shard",
        "torch.distributed.tensor.placement_types._StridedShard"),
        "a DTensor record: torch.load(weights_only=True) accepts it once torch.distributed.tensor is imported"),
    **dict.fromkeys(("decimal.Decimal", "fractions.Fraction", "uuid.UUID", "ipaddress.IPv4Address",
                     "ipaddress.IPv6Address", "ipaddress.IPv4Network", "ipaddress.IPv6Network"),
                    "a standard-library value (a number, an identifier or an address): builds it, runs nothing"),
    "torch._utils._rebuild_xla_tensor": "rebuilds an XLA tensor from its saved values (torch.save writes it)",
    # DeepSpeed's ZeRO optimizer states (zero_pp_rank_*_optim_states.pt): a dataclass of offsets, written by every
    # ZeRO 1/2 save; DeepSpeed itself loads these files with weights_only=False
    "deepspeed.utils.tensor_fragment.fragment_address": "DeepSpeed's record of a parameter's place in the flat "
                                                        "buffer (a dataclass of two numbers): builds it, runs nothing",
    "torch.amp.grad_scaler._refresh_per_optimizer_state": "GradScaler's default factory (returns a fresh dict)",
    "torch.cuda.amp.grad_scaler._refresh_per_optimizer_state": "GradScaler's default factory (returns a fresh dict)",
    **{n: "torch.distributed.checkpoint writes it in .metadata: a record of where tensors lie"
       for n in DCP_GLOBALS if not n.startswith("pathlib.")},
}

_NN = "a torch.nn module: rebuilt from its saved attributes"
_OPTIM = ("a torch optimizer or LR scheduler: rebuilt from its saved attributes (functions it holds are rated on "
          "their own)")
_SCALER = "torch.amp's GradScaler: rebuilt from its saved scale and counters"
_NP_RANDOM = "a numpy bit generator or RandomState: rebuilt from its saved state"

#: modules whose classes (``module.CapWordsName``, defined in exactly that module: a class reached through a module
#: attribute of it, such as ``torch.optim.lr_scheduler.types.CodeType``, is not one) need trust but carry state only.
#: The torch.nn and torch.optim submodules are those of torch 2.13 (``ls torch/nn/modules torch/optim``)
NEEDS_TRUST_MODULES: dict[str, str] = {
    **{f"torch.nn.modules.{m}": _NN for m in (
        "activation", "adaptive", "batchnorm", "channelshuffle", "container", "conv", "distance", "dropout",
        "flatten", "fold", "instancenorm", "lazy", "linear", "linear_cross_entropy", "linear_cross_entropy_options",
        "loss", "module", "normalization", "padding", "pixelshuffle", "pooling", "rnn", "sparse", "transformer",
        "upsampling")},
    "torch.nn.parameter": "a torch parameter or buffer class: rebuilt from its saved tensor",
    **{f"torch.optim.{m}": _OPTIM for m in (
        "_adafactor", "_muon", "adadelta", "adagrad", "adam", "adamax", "adamw", "asgd", "lbfgs", "lr_scheduler",
        "nadam", "optimizer", "radam", "rmsprop", "rprop", "sgd", "sparse_adam", "swa_utils")},
    "torch.amp.grad_scaler": _SCALER, "torch.cuda.amp.grad_scaler": _SCALER,
    **{f"torch.distributed.checkpoint.{m}": "a torch.distributed.checkpoint metadata record"
       for m in ("metadata", "planner")},
    "torch.torch_version": "torch's version string class",
    "numpy.random": _NP_RANDOM,
    **{f"numpy.random.{m}": _NP_RANDOM for m in (
        "mtrand", "_generator", "bit_generator", "_mt19937", "_pcg64", "_philox", "_sfc64")},
    "numpy.dtypes": "a numpy dtype class",
    "collections": "a standard container class", "collections.abc": "an abstract container class",
    "enum": "an enum class",
    "builtins": "a built-in exception or warning class: builds it from the file's data, runs nothing",
}

_DCP_DATA = ("torch.distributed.checkpoint's own metadata record in .metadata (FileSystemReader rebuilds it as "
             "data; a pathlib path is plain data here, no method of it is called)")

#: the globals accelerate adds to torch's safe globals when it reads its own files
#: (``accelerate.utils.other.TORCH_SAFE_GLOBALS``: numpy arrays and dtypes, for the RNG state)
ACCELERATE_SAFE_GLOBALS = frozenset({
    "numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
    "numpy.dtypes.UInt32DType", "_codecs.encode"})
#: the keys of accelerate's ``save_state`` RNG file (``random_states_<process>.pkl``, accelerate/checkpointing.py)
ACCELERATE_RNG_KEYS = frozenset({"random_state", "numpy_random_seed", "torch_manual_seed"})
ACCELERATE_RNG = "accelerate-rng-state"


def recognise_file(root_keys: Iterable[object], names: Iterable[str]) -> tuple[str, str] | None:
    """``(kind, description)`` when a pickle is a known library file, from its content (never its file name):
    ``root_keys`` are the keys of its top-level dict, ``names`` every global it names. Known today:

    * accelerate's ``save_state`` RNG state (``random_states_<process>.pkl``): keys ``random_state`` (Python's
      ``random.getstate()``), ``numpy_random_seed`` (``numpy.random.get_state()``: a numpy array) and
      ``torch_manual_seed``, and no global outside ``torch.load(weights_only=True)``'s allowlist and
      :data:`ACCELERATE_SAFE_GLOBALS`. It needs trust, not more: ``accelerate.load_state`` reads it with
      ``weights_only=True`` after ``torch.serialization.add_safe_globals`` of those numpy names.

    None for anything else (a file that matches the keys but names other globals is rated by its globals alone).
    """
    keys = {k for k in root_keys if type(k) is str}
    if keys >= ACCELERATE_RNG_KEYS and all(n in WEIGHTS_ONLY_ALLOWED or n in ACCELERATE_SAFE_GLOBALS for n in names):
        return ACCELERATE_RNG, ("accelerate's save_state RNG state (Python, numpy and torch random states): "
                                "accelerate.load_state reads it with torch.load(weights_only=True) plus numpy "
                                "arrays and dtypes as safe globals; it needs trust in numpy, runs no code of the "
                                "file's choosing")
    return None


#: names TorchScript's C++ unpickler resolves itself (torch/csrc/jit/serialization/unpickler.cpp), never importing
TORCHSCRIPT_NAMES = frozenset({
    "torch.jit._pickle.build_intlist", "torch.jit._pickle.build_tensorlist", "torch.jit._pickle.build_doublelist",
    "torch.jit._pickle.build_boollist", "torch.jit._pickle.build_tensor_from_id", "torch.jit._pickle.restore_type_tag",
})


#: the top-level modules of the standard library (``sys.stdlib_module_names``; ``__main__`` is the user's script)
STDLIB_MODULES: frozenset[str] = frozenset(sys.stdlib_module_names) - {"__main__"}
#: packages whose classes ckptool knows: a class of theirs on no list is dangerous, not an unknown class (they are
#: installed wherever the file is loaded, so "trust the package" decides nothing, and their constructors open
#: files, sockets, processes and databases: ``_pyio.FileIO``, ``sqlite3.Connection``, numpy's ``DataSource``)
KNOWN_PACKAGES: frozenset[str] = STDLIB_MODULES | {"numpy"}
#: top-level modules that a dotted path may reach as a module attribute of another module (``subprocess`` in
#: ``torch.utils.cpp_extension.subprocess.Popen``: ``import subprocess`` in that module makes it an attribute)
REEXPORTABLE: frozenset[str] = KNOWN_PACKAGES | {"torch", "dill", "cloudpickle", "joblib", "requests", "cffi",
                                                 "setuptools", "pip", "tensorboardX"}
#: names with more dotted parts than this are rated dangerous without reading them further (real ones have < 10)
MAX_NAME_PARTS = 32


def _dangerous_reason(name: str) -> str | None:
    """What the known gadget ``name`` can do (:data:`DANGEROUS_NAMES`, then the longest :data:`DANGEROUS_MODULES`
    prefix), or None."""
    why = DANGEROUS_NAMES.get(name)
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if why is not None:
            break
        why = DANGEROUS_MODULES.get(".".join(parts[:i]))
    return why


def _module_of_class(name: str) -> str | None:
    """The module of ``name`` when it has the shape of a module-level class (``pkg.mod.ClassName``: the last part
    starts with an uppercase letter, every part before it with a lowercase letter or ``_``, ``__main__``...), else
    None (a function, a constant, an attribute inside a class such as ``pathlib.Path.write_text``)."""
    module, _, last = name.rpartition(".")
    if not module or not last[:1].isupper():
        return None
    if any(not p or not (p.lstrip("_")[:1].islower() or p.strip("_") == p.strip("_").lower()) for p in
           module.split(".")):
        return None
    return module


def _exact_rating(name: str, torchscript: bool, dcp_metadata: bool) -> tuple[str, str] | None:
    """The rating of ``name`` when a list names it exactly (each entry is a real object of a real module, so the
    rating holds whatever path the name takes), else None."""
    if is_allowed(name):
        return ALLOWED, "accepted by torch.load(weights_only=True)"
    if dcp_metadata and name in DCP_GLOBALS:
        return ALLOWED, _DCP_DATA
    if torchscript and (name.startswith("__torch__.") or name in TORCHSCRIPT_NAMES):
        return ALLOWED, "resolved by torch.jit.load's own unpickler, not imported"
    if name in TORCHSCRIPT_NAMES:
        return NEEDS_TRUST, "a TorchScript list builder; outside a TorchScript archive torch.load imports it"
    why = NEEDS_TRUST_NAMES.get(name)
    if why is not None:
        return NEEDS_TRUST, why
    why = DANGEROUS_NAMES.get(name)
    if why is not None:
        return DANGEROUS, why
    return None


_NO_LIST_FUNCTION = "a function on no list: loading would call it with arguments the file chooses"


def _path_rating(name: str) -> tuple[str, str]:
    """The rating of ``name`` read as a path of modules ending in the object (rules 2-6 of the module docstring)."""
    module = _module_of_class(name)
    if module is not None and module in NEEDS_TRUST_MODULES:
        return NEEDS_TRUST, NEEDS_TRUST_MODULES[module]
    why = _dangerous_reason(name)
    if why is not None:
        return DANGEROUS, why
    if module is None:
        return DANGEROUS, _NO_LIST_FUNCTION
    top = module.split(".", 1)[0]
    if top in KNOWN_PACKAGES:
        what = "numpy" if top == "numpy" else "the standard library"
        return DANGEROUS, (f"a class of {what} on no list: its constructor, called with the file's arguments, may "
                           "open files, sockets, processes or databases (no list shows it harmless)")
    return UNKNOWN, "a class on no list: loading imports its package and builds it from the file's data"


def _use_reason(name: str, use: str) -> str:
    """Why the use ``use`` of global ``name`` (recorded by :func:`ckptool.formats.nodes.use_key`) is dangerous."""
    if use == CLASS_BUILD:
        return (f"the pickle BUILDs on the class {name} itself (class mutation: pickle sets attributes the file "
                "chose on the class, and every later use of it in the process runs with them; "
                "torch.load(weights_only=True) refuses it)")
    if use.startswith(ALLOC):
        size = use[len(ALLOC):]
        return (f"a call of {name} asks to allocate {size} bytes when loaded (a memory bomb: over ckptool's limit of "
                f"{MAX_REQUEST_BYTES} bytes per call; torch.save never writes such a call)")
    return f"an unsafe use of {name} ({use})"


@functools.lru_cache(maxsize=1)
def _known_modules() -> frozenset[str]:
    """Modules (and their parent packages) that the lists show are real modules: those of
    :data:`NEEDS_TRUST_MODULES` and of every exactly listed name. A part of a dotted name inside one of them is that
    module's submodule, not another module imported there."""
    names = [*WEIGHTS_ONLY_ALLOWED, *NEEDS_TRUST_NAMES, *DANGEROUS_NAMES, *TORCHSCRIPT_NAMES, *DCP_GLOBALS]
    modules = {n.rpartition(".")[0] for n in names} | set(NEEDS_TRUST_MODULES)
    return frozenset(".".join(m.split(".")[:i]) for m in modules for i in range(1, m.count(".") + 2))


def _listed_danger(name: str, torchscript: bool, dcp_metadata: bool) -> str | None:
    """What ``name`` can do when a list makes it dangerous (an exact entry, a :data:`DANGEROUS_MODULES` module),
    else None: a name on no list (``token.Tokenizer``) is not made dangerous by the general rules here, because a
    package's own submodule often shares a standard module's name (``mypkg.token``)."""
    exact = _exact_rating(name, torchscript, dcp_metadata)
    if exact is not None:
        return exact[1] if exact[0] == DANGEROUS else None
    return _dangerous_reason(name)


def classify_global(name: str, *, torchscript: bool = False, dcp_metadata: bool = False) -> tuple[str, str]:
    """``(status, reason)`` of the global ``module.qualname`` (Python 3 names: :func:`ckptool.formats.nodes.
    qualified_name` maps Python 2 ones first), by the rules of this module's docstring. ``dcp_metadata``: the name is
    in a torch.distributed.checkpoint ``.metadata`` pickle, where DCP's own record classes and ``pathlib`` paths
    (:data:`DCP_GLOBALS`) are allowed.

    A dotted name is the object it reaches, not the module it starts in: ``pickle`` walks ``qualname`` attribute by
    attribute (``STACK_GLOBAL`` of ``torch.utils.cpp_extension`` + ``subprocess.Popen``), and a module attribute
    can be another module (``import subprocess`` there). So a name no list names exactly is dangerous when a
    shorter name that starts at one of its parts naming a top-level module (:data:`REEXPORTABLE`), past the modules
    the lists show are real, is dangerous by a list (``subprocess.Popen``, ``types.CodeType``). Nothing is
    imported: which attributes really are modules is not looked up, so a package's own submodule that shares a
    dangerous standard module's name (``mypkg.io.Reader``) is rated as that module too.

    ``status`` is :data:`ALLOWED` (in the ``torch.load(weights_only=True)`` allowlist, or resolved by TorchScript's
    own unpickler when ``torchscript`` is true), :data:`NEEDS_TRUST` (a known library class or rebuilder that runs
    no code of the file's choosing), :data:`DANGEROUS` (a known gadget, a function on no list, a standard-library or
    numpy class on no list; ``reason`` says what it can do) or :data:`UNKNOWN` (a class of another package on no
    list: loading would import and build it). :func:`level_of` turns it into a scan level.
    """
    base, use = split_use(name)
    if use is not None:
        return DANGEROUS, _use_reason(base, use)
    exact = _exact_rating(name, torchscript, dcp_metadata)
    if exact is not None:
        return exact
    parts = name.split(".")
    if len(parts) > MAX_NAME_PARTS:
        return DANGEROUS, f"a name of {len(parts)} dotted parts: no real module path is that deep"
    rating = _path_rating(name)
    if rating[0] == DANGEROUS and rating[1] != _NO_LIST_FUNCTION:
        return rating
    known = next((i for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in _known_modules()), 1)
    for i in range(known, len(parts) - 1):
        if parts[i] not in REEXPORTABLE:
            continue
        reached = ".".join(parts[i:])
        why = _listed_danger(reached, torchscript, dcp_metadata)
        if why is not None:
            via = ".".join(parts[:i + 1])
            return DANGEROUS, (f"{via} can be the module {parts[i]} imported there (a module attribute), which "
                               f"makes this {reached}: {why}")
    return rating


def refusal_remedy(path: str, names: Iterable[str]) -> str:
    """What to do about ``path``, whose pickle names ``names`` (``module.qualname``) outside the weights_only
    allowlist: ``ckptool sanitize`` first (it converts numpy arrays and scalars, ``argparse.Namespace`` and other
    plain records, pickled modules, without running anything; what it cannot convert it names with its key path),
    trusting the file second. When a name is :data:`DANGEROUS` the advice is to scan it and not to trust it.
    One or two sentences, starting with a capital."""
    dangerous = [n for n in names if classify_global(n)[0] == DANGEROUS]
    if dangerous:
        bombs = all((split_use(n)[1] or "").startswith(ALLOC) for n in dangerous)
        harm = "exhaust your machine's memory" if bombs else "run code on your machine"
        return (f"It names {', '.join(dangerous[:3])}, which can {harm}: do not load it with "
                f"trust; see `ckptool scan {path}`")
    return (f"Convert it without running it: `ckptool sanitize {path} -o OUT.pth` (numpy arrays become tensors, "
            "argparse.Namespace records dicts, a pickled model its state_dict); or pass trust=True (--trust) only "
            "if you trust its source")


# ------------------------------------------------------------------------------------------------ uses of a global
def is_importable_name(name: str) -> bool:
    """True when ``module.qualname`` (a use key's global part, :func:`ckptool.formats.nodes.split_use`) is Python
    identifiers joined by dots, as every name ``find_class`` can import is: ``hat_template: "{% for m %}".bos: 1``
    (a YAML file read as a protocol-0 pickle) fails there, before anything is called."""
    base = split_use(name)[0]
    return bool(base) and all(part.isidentifier() for part in base.split("."))


NOT_IMPORTABLE = ("not a Python name (its parts are not identifiers): no loader can import it, loading fails when "
                  "it reaches it (ModuleNotFoundError), before anything is called")


def rate_global(name: str, *, called: bool = True, torchscript: bool = False,
                dcp_metadata: bool = False) -> tuple[str, str]:
    """``(status, reason)`` of the global ``name`` as ``ckptool scan`` rates it in one pickle: :func:`classify_global`,
    and then what the pickle does with it.

    * A name that is not :func:`is_importable_name` is :data:`NEEDS_TRUST` at most, never dangerous (no loader can
      import it; the scan reports the pickle as unreadable).
    * ``called=False`` (never called, instantiated, BUILT on nor passed to a call:
      :meth:`ckptool.formats.unpickler.RestrictedUnpickler.uncalled_globals`; ``typing.Any`` in OmegaConf
      metadata): a name dangerous only by the general rules (a function, or a standard-library or numpy class, on
      no list) needs trust instead. A known gadget (:data:`DANGEROUS_NAMES`, :data:`DANGEROUS_MODULES`, also
      through a module attribute) stays dangerous: code that uses the loaded object may call it.

    The rules read fixed tables, so a rating is remembered (:data:`RATED_NAME_CHARS`; issue 52: many files).
    """
    rate = _rate_remembered if len(name) <= RATED_NAME_CHARS else _rate
    return rate(name, called, torchscript, dcp_metadata)


#: the longest global name whose rating is remembered (an LRU of 4096 names); longer ones are rated each time
RATED_NAME_CHARS = 200


def _rate(name: str, called: bool, torchscript: bool, dcp_metadata: bool) -> tuple[str, str]:
    """:func:`rate_global`, worked out."""
    if not is_importable_name(name):
        return NEEDS_TRUST, NOT_IMPORTABLE
    status, reason = classify_global(name, torchscript=torchscript, dcp_metadata=dcp_metadata)
    if called or status != DANGEROUS or split_use(name)[1] is not None or len(name.split(".")) > MAX_NAME_PARTS:
        return status, reason
    if _listed(name, status, reason):
        return status, reason  # a listed gadget, or one reached through a module attribute
    top = name.split(".", 1)[0]
    value = ("held only as a value (the pickle never calls it, instantiates it, BUILDs on it or passes it to a "
             "call): loading imports it and calls nothing")
    if top in KNOWN_PACKAGES:
        return NEEDS_TRUST, f"{value}; code that uses the loaded object may call it"
    return UNKNOWN, (f"{value} (importing its package runs that package's code); code that uses the loaded object "
                     "may call it")


_rate_remembered = functools.lru_cache(maxsize=4096)(_rate)


def _listed(name: str, status: str, reason: str) -> bool:
    """True when :func:`classify_global`'s ``(status, reason)`` of ``name`` comes from a list (an exact entry, a
    :data:`DANGEROUS_MODULES` module, also reached through a module attribute), not from the general rules alone."""
    return (name in DANGEROUS_NAMES or _dangerous_reason(name) is not None
            or (status, reason) != _path_rating(name))


def rate_target(target: str) -> tuple[str, str]:
    """``(status, reason)`` of a Hydra ``_target_`` (a NeMo ``model_config.yaml``: ``hydra.utils.instantiate``
    imports it and calls it with the config's arguments, CVE-2025-23304), by the rules of :func:`rate_global` for a
    global the pickle calls: a listed gadget (``builtins.exec``, ``os.system``, ``subprocess.Popen``) or a function
    of the standard library or numpy on no list is dangerous; a class or function of another package
    (``nemo.collections.asr.models.EncDecCTCModel``, ``torch.optim.AdamW``) needs trust in that package (the
    config chooses the arguments of one of its own callables); a name that is no Python name needs trust at most
    (Hydra cannot locate it)."""
    if not is_importable_name(target) or USE_MARK in target:
        return NEEDS_TRUST, "not a Python name: Hydra cannot locate it (instantiating fails there)"
    status, reason = rate_global(target, called=True)
    if status != DANGEROUS or _listed(target, status, reason) or target.split(".", 1)[0] in KNOWN_PACKAGES:
        return status, f"Hydra imports and calls it when the model is restored: {reason}"
    return UNKNOWN, ("a callable of its package that Hydra imports and calls with the config's arguments when the "
                     "model is restored: load it only if you trust the file and that package")
