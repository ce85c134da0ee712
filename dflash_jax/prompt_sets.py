"""Prompt sets built offline: code tasks from the Python standard library and seed topics, and
long-context tasks over the standard library's own prose.

Three sources, each written as JSONL rows with the fields the loaders read (`instruction`,
`category`, `source`):

* **code-stdlib**: every public pure-Python function (and method of a public class) of the
  modules in `STDLIB_MODULES` that has a signature, readable source and a docstring becomes
  "Implement this Python function: <signature + docstring>" (one of `STDLIB_INSTRUCTIONS`,
  picked by a hash of the function's name). The functions of `HELDOUT_MODULES` form the
  held-out evaluation set (`code_heldout.jsonl`), the rest the training set
  (`code_stdlib_train.jsonl`); a training prompt whose signature and docstring also occur in
  the held-out set is dropped, so no function's text is on both sides. The docstrings are the
  Python Software Foundation's (PSF License); which functions exist depends on the Python
  version, so the counts are recorded with it (`meta`).
* **code-topics**: `TOPICS` x `TOPIC_INSTRUCTIONS`: prompts that ask the target to invent a
  programming task on a topic and solve it (the target writes the task and its solution when
  `make-data` lets it answer).
* **context**: passages of 1.8K-3.2K characters cut at paragraph breaks from the standard
  library's prose (the language reference topics in `pydoc_data.topics` and the long docstrings
  of `STDLIB_MODULES`' modules and classes, the held-out modules' left out), each made into a
  summarisation, a question-over-the-passage ("rag") and an extraction prompt
  (`CONTEXT_INSTRUCTIONS`). The training responses then copy from and condense a long context
  at positions past 512, which the short code, chat and math prompts never reach.

Rows are ordered by a CRC-32 of their `source`, the same on every machine, so that the first N
rows (`--limit`, `FILE:N`) mix modules and topics instead of taking one module.
"""
from __future__ import annotations

import importlib
import inspect
import json
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

from dflash_jax.files import atomic_write_text

# Long-standing pure-Python modules (none removed up to Python 3.13); a module that does not
# import on this interpreter (a build without it) is left out and not listed in `meta`.
STDLIB_MODULES = (
    "argparse", "ast", "asyncio.locks", "asyncio.queues", "base64", "bdb", "calendar", "cmd", "code",
    "codeop", "collections", "concurrent.futures", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "difflib", "dis", "doctest", "email.message", "email.utils", "enum", "filecmp",
    "fileinput", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "graphlib",
    "gzip", "heapq", "hmac", "html", "html.parser", "http.client", "http.cookiejar", "http.cookies",
    "imaplib", "inspect", "ipaddress", "json", "json.decoder", "json.encoder", "linecache", "locale",
    "logging", "logging.handlers", "lzma", "mailbox", "mimetypes", "netrc", "optparse", "os", "pathlib",
    "pickletools", "pkgutil", "platform", "plistlib", "poplib", "posixpath", "pprint", "queue", "quopri",
    "random", "reprlib", "sched", "secrets", "selectors", "shlex", "shutil", "smtplib", "socket",
    "socketserver", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
    "timeit", "tokenize", "trace", "traceback", "types", "typing", "unittest.case", "urllib.parse",
    "urllib.request", "uuid", "warnings", "weakref", "xml.dom.minidom", "xml.etree.ElementTree", "zipfile",
    # More of the same kind, for a larger training split (the held-out set is unchanged).
    "asyncio.base_events", "asyncio.events", "asyncio.protocols", "asyncio.streams", "asyncio.subprocess",
    "asyncio.tasks", "asyncio.transports", "bz2", "compileall", "concurrent.futures.process", "email.charset",
    "email.generator", "email.header", "email.headerregistry", "email.parser", "email.policy", "getpass",
    "http.server", "importlib.metadata", "logging.config", "modulefinder", "multiprocessing.connection",
    "multiprocessing.managers", "multiprocessing.pool", "pdb", "pstats", "pyclbr", "pydoc", "rlcompleter",
    "shelve", "symtable", "sysconfig", "tracemalloc", "unittest.loader", "unittest.mock", "unittest.result",
    "unittest.runner", "urllib.robotparser", "venv", "webbrowser", "wsgiref.handlers", "wsgiref.headers",
    "wsgiref.simple_server", "wsgiref.util", "xml.dom.pulldom", "xml.sax.expatreader", "xml.sax.handler",
    "xml.sax.saxutils", "xmlrpc.client", "xmlrpc.server",
)
# The held-out code set: whole modules, so that no training prompt shares a module's code.
# Chosen for self-contained, algorithmic functions, the kind a user asks a model to write.
HELDOUT_MODULES = ("base64", "calendar", "difflib", "fnmatch", "fractions", "graphlib", "heapq",
                   "ipaddress", "random", "shlex", "statistics", "textwrap")
# Docstrings shorter than this say too little to implement from; longer ones than the cap make
# prompts that `make-data --max-prompt-tokens` would skip anyway.
MIN_DOC_CHARS = 40
MAX_DOC_CHARS = 1500

STDLIB_INSTRUCTIONS = (
    "Implement this Python function:",
    "Write the body of the following Python function so that it does what its docstring says:",
    "Complete this Python function. Give the whole function, then explain it briefly:",
    "Here is a signature with its docstring. Write a correct, readable Python implementation:",
)

TOPIC_INSTRUCTIONS = (
    "Write a short programming exercise about {topic}, then solve it: "
    "give the code and explain how it works.",
    "Invent a realistic coding task that involves {topic}. State the task, then write a complete "
    "solution with comments.",
    "Create an interview-style coding question on {topic} and answer it with working code and its "
    "time and space complexity.",
)

TOPICS = (
    "binary search", "two-pointer techniques", "sliding windows", "prefix sums", "hash maps",
    "sets and deduplication", "stacks", "queues and deques", "priority queues", "linked lists",
    "binary trees", "binary search trees", "tries", "union-find", "graph breadth-first search",
    "graph depth-first search", "Dijkstra's shortest paths", "topological sorting", "minimum spanning trees",
    "dynamic programming on sequences", "knapsack problems", "memoization", "recursion and backtracking",
    "generating permutations and combinations", "bit manipulation", "sorting algorithms",
    "merge intervals", "matrix traversal", "string parsing", "regular expressions", "palindromes",
    "anagram grouping", "run-length encoding", "Unicode text handling", "number formatting",
    "date and time arithmetic", "time zones", "reading and writing CSV files", "JSON serialization",
    "parsing command-line arguments", "file system walking", "log file analysis", "configuration files",
    "error handling with exceptions", "context managers", "iterators and generators", "decorators",
    "closures", "classes and inheritance", "dataclasses", "abstract base classes", "operator overloading",
    "type hints", "unit testing", "mocking in tests", "property-based testing", "logging",
    "threads and locks", "producer-consumer queues", "asyncio coroutines", "process pools", "rate limiting",
    "caching with LRU eviction", "retry with exponential backoff", "HTTP requests", "REST API design",
    "URL parsing", "web scraping an HTML page", "SQL joins", "SQL aggregation queries", "database transactions",
    "an in-memory key-value store", "a tokenizer for arithmetic expressions", "an expression evaluator",
    "a tiny virtual machine", "a text-based game", "matrix multiplication", "numerical integration",
    "random sampling", "statistics of a data set", "prime numbers", "greatest common divisors",
    "big integer arithmetic", "fractions and exact arithmetic", "geometry with points and polygons",
    "image pixels as arrays", "vectorized operations with NumPy", "data frames with pandas",
    "plotting a chart", "shell scripting with Bash", "JavaScript promises", "DOM manipulation in JavaScript",
    "pointers and memory in C", "ownership and borrowing in Rust", "generics in Java", "Go goroutines and channels",
    "a command-line to-do list", "a bank account simulation", "an inventory system", "a URL shortener",
    "segment trees", "Fenwick trees", "heaps built by hand", "hash table collision handling",
    "ring buffers", "bloom filters", "skip lists", "LRU caches built from a dictionary and a list",
    "interval scheduling", "A* path finding", "Bellman-Ford shortest paths", "strongly connected components",
    "cycle detection in graphs", "bipartite graph checks", "flood fill", "maze generation", "sudoku solving",
    "the N-queens puzzle", "edit distance", "longest common subsequence", "coin change", "matrix chain ordering",
    "string matching with KMP", "rolling hashes", "suffix arrays", "base conversion", "roman numerals",
    "checksums and CRCs", "binary file formats with struct", "compressing data with zlib", "hashing passwords",
    "generating random passwords", "UUIDs", "semantic version comparison", "diffing two texts",
    "word frequency counting", "text wrapping and justification", "Markdown to HTML conversion",
    "templating strings", "INI file parsing", "YAML-like indentation parsing", "a tiny JSON parser",
    "a calculator with operator precedence", "a stack-based bytecode interpreter", "a finite state machine",
    "an event loop from scratch", "a publish-subscribe system", "an undo and redo stack",
    "dependency injection", "the observer pattern", "the strategy pattern", "the builder pattern",
    "immutable data structures", "copying objects deeply", "weak references", "slots and memory use",
    "descriptors", "metaclasses", "enumerations", "pattern matching with match statements",
    "walrus assignments in comprehensions", "f-string formatting", "sorting with key functions",
    "grouping with itertools", "functools partial and reduce", "a priority task scheduler",
    "a thread pool from scratch", "timeouts for slow calls", "signal handling", "subprocess pipelines",
    "temporary files and directories", "atomic file writes", "watching a directory for changes",
    "zip archives", "tar archives", "a simple HTTP server", "a socket echo server", "an SMTP email message",
    "parsing email headers", "sending JSON over a socket", "a chat server with asyncio", "websocket framing",
    "pagination of API results", "input validation", "sanitizing user input for SQL", "an ORM-like query builder",
    "database migrations", "SQLite with Python", "a CSV report generator", "a histogram in the terminal",
    "Monte Carlo estimation of pi", "Newton's method", "the sieve of Eratosthenes", "matrix determinants",
    "complex numbers", "unit conversion", "currency arithmetic with decimals", "calendars and leap years",
    "a stopwatch and timers", "profiling slow code", "memoizing recursive functions in C++",
    "templates in C++", "closures in JavaScript", "async and await in TypeScript", "traits in Rust",
    "error handling in Go", "streams in Java", "LINQ queries in C#", "SQL window functions",
)


def _order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows in the order of their source's CRC-32 (a hash that no interpreter seeds)."""
    return sorted(rows, key=lambda r: (zlib.crc32(r["source"].encode()), r["source"]))


# ----------------------------------------------------------------------------- stdlib tasks

def _members(module: Any) -> Iterator[tuple[str, Callable[..., Any]]]:
    """(qualified name, function) for the public functions defined in `module`, and the public
    methods (plain, static or class) of its public classes, sorted by name."""
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            yield name, obj
        elif inspect.isclass(obj):
            for attr, member in sorted(vars(obj).items()):
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if not attr.startswith("_") and inspect.isfunction(member):
                    yield f"{name}.{attr}", member


def _task_text(func: Callable[..., Any], name: str) -> str | None:
    """`def name(signature):` + its docstring, as a code block; None when the function does not
    qualify (no docstring of MIN_DOC_CHARS..MAX_DOC_CHARS, no signature or source, or a signature
    whose defaults print object addresses, which differ from run to run)."""
    doc = inspect.getdoc(func)
    if not doc or not MIN_DOC_CHARS <= len(doc) <= MAX_DOC_CHARS or '"""' in doc:
        return None
    try:
        signature = str(inspect.signature(func))
        inspect.getsource(func)  # pure Python: a C function has no source
    except (TypeError, ValueError, OSError):
        return None
    if " at 0x" in signature:
        return None
    prefix = "async def" if inspect.iscoroutinefunction(func) else "def"
    body = "\n".join(("    " + line).rstrip() for line in doc.splitlines()).lstrip()
    return f'```python\n{prefix} {name.rsplit(".", 1)[-1]}{signature}:\n    """{body}\n    """\n```'


def stdlib_tasks(modules: tuple[str, ...] = STDLIB_MODULES) -> tuple[list[dict[str, Any]], list[str]]:
    """Every qualifying function of `modules` as a prompt row -> (rows, the modules imported).

    Row: {"instruction", "category": "code", "source": "module.function", "module"}. Methods name
    their class: "Implement this method of the Python class `C`: ...".
    """
    rows: list[dict[str, Any]] = []
    found: list[str] = []
    for module_name in modules:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a deprecation notice is no reason to leave a module out
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
        found.append(module_name)
        for name, func in _members(module):
            text = _task_text(func, name)
            if text is None:
                continue
            source = f"{module_name}.{name}"
            instruction = STDLIB_INSTRUCTIONS[zlib.crc32(source.encode()) % len(STDLIB_INSTRUCTIONS)]
            if "." in name:  # a method: the instruction names its class
                owner = f"the Python class `{name.split('.')[0]}`"
                if "Python function" in instruction:
                    instruction = instruction.replace("Python function", f"method of {owner}")
                else:
                    instruction = instruction.replace("Python implementation", f"implementation of this method of "
                                                      f"{owner}")
            rows.append({"instruction": f"{instruction}\n\n{text}", "category": "code", "source": source,
                         "module": module_name})
    return rows, found


def _task_of(row: dict[str, Any]) -> str:
    """The signature + docstring block of a stdlib row (its text without the instruction)."""
    return row["instruction"].split("\n\n", 1)[1]


def split_stdlib(rows: list[dict[str, Any]], heldout: tuple[str, ...] = HELDOUT_MODULES
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """-> (training rows, held-out rows), each in CRC-32 order. Held out: the rows of `heldout`
    modules; a training row whose task text also occurs among them is dropped."""
    held = [r for r in rows if r["module"] in heldout]
    texts = {_task_of(r) for r in held}
    train = [r for r in rows if r["module"] not in heldout and _task_of(r) not in texts]
    return _order(train), _order(held)


# ----------------------------------------------------------------------------- topic tasks

def topic_tasks() -> list[dict[str, Any]]:
    """TOPICS x TOPIC_INSTRUCTIONS as prompt rows (source "topic:<i>:<j>"), in CRC-32 order."""
    rows = [{"instruction": template.format(topic=topic), "category": "code", "source": f"topic:{i}:{j}"}
            for i, topic in enumerate(TOPICS) for j, template in enumerate(TOPIC_INSTRUCTIONS)]
    return _order(rows)


# ----------------------------------------------------------------------------- context tasks

# Passage length in characters (about 450 to 800 tokens): spec_bench-style long prompts.
CONTEXT_MIN_CHARS = 1800
CONTEXT_MAX_CHARS = 3200
# A docstring shorter than this is a sentence or two, not a passage.
CONTEXT_MIN_DOC_CHARS = 600

# {passage}: the text; {subject}: what it documents ("the assignment statement topic", "the
# argparse module").
CONTEXT_INSTRUCTIONS = {
    "summarization": (
        "Summarize: {passage}",
        "Summarize the following text in a few sentences.\n\n{passage}",
        "Here is a passage from a programming manual:\n\n{passage}\n\nWrite a short summary of it for a "
        "newcomer.",
        "{passage}\n\nSum up the text above in one paragraph.",
    ),
    "rag": (
        "{passage}\nWhat does the text above say about {subject}?",
        "{passage}\n\nUsing only the passage above, explain {subject} in your own words.",
        "Read this documentation:\n\n{passage}\n\nQuestion: what are the most important rules it gives "
        "about {subject}?",
    ),
    "extraction": (
        "Extract every keyword, function, class and module name mentioned in the text below, and "
        "list each with a one-line description.\n\n{passage}",
        "{passage}\n\nList the terms this text defines, one per line, each with its definition in "
        "the text's own words.",
    ),
}


def split_passages(text: str, lo: int = CONTEXT_MIN_CHARS, hi: int = CONTEXT_MAX_CHARS) -> list[str]:
    """`text` cut at paragraph breaks into passages of lo..hi characters.

    Paragraphs are joined in order until a passage reaches `lo`; a paragraph longer than `hi` is
    cut at line breaks first (a line longer than `hi` is left out: a table or a grammar dump). A
    passage still short of `lo` when the next piece would take it past `hi` is dropped, and so is
    a short remainder at the end unless it fits into the last passage.
    """
    pieces: list[str] = []
    for para in (p.strip() for p in text.split("\n\n")):
        if len(para) <= hi:
            pieces += [para] if para else []
        else:
            pieces += [line for line in para.splitlines() if line.strip() and len(line) <= hi]
    passages: list[str] = []
    current = ""
    for piece in pieces:
        joined = f"{current}\n\n{piece}" if current else piece
        if len(joined) > hi:
            if len(current) >= lo:
                passages.append(current)
            current = piece
        else:
            current = joined
        if len(current) >= lo:
            passages.append(current)
            current = ""
    if current and passages and len(passages[-1]) + 2 + len(current) <= hi:
        passages[-1] = f"{passages[-1]}\n\n{current}"
    return passages


def _prose_sources(modules: tuple[str, ...]) -> Iterator[tuple[str, str, str]]:
    """(source, subject, text) of the standard library's prose: the language reference topics
    of `pydoc_data.topics` (when this build has it), then the long docstrings of `modules` and
    of their public classes."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        topics = {}
    for name, text in sorted(topics.items()):
        yield f"topic:{name}", f"the '{name.replace('-', ' ')}' topic of the Python language", text
    for module_name in modules:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
        doc = inspect.getdoc(module) or ""
        if len(doc) >= CONTEXT_MIN_DOC_CHARS:
            yield f"doc:{module_name}", f"the Python module {module_name}", doc
        for name, obj in sorted(vars(module).items()):
            if inspect.isclass(obj) and not name.startswith("_") and obj.__module__ == module_name:
                doc = inspect.getdoc(obj) or ""
                if len(doc) >= CONTEXT_MIN_DOC_CHARS:
                    yield f"doc:{module_name}.{name}", f"the class {name} of the Python module {module_name}", doc


def context_tasks(modules: tuple[str, ...] = STDLIB_MODULES, heldout: tuple[str, ...] = HELDOUT_MODULES
                  ) -> list[dict[str, Any]]:
    """Every passage of the standard library's prose (`split_passages`) x every kind of
    `CONTEXT_INSTRUCTIONS` as prompt rows, in CRC-32 order.

    Row: {"instruction", "category": kind, "source": "<source>#<passage>:<kind>"}; the template
    of a kind is picked by a hash of the source. The held-out modules' docstrings are left out, so
    that no held-out code task's text reaches training through a passage.
    """
    rows: list[dict[str, Any]] = []
    for source, subject, text in _prose_sources(tuple(m for m in modules if m not in heldout)):
        for n, passage in enumerate(split_passages(text)):
            for kind, templates in CONTEXT_INSTRUCTIONS.items():
                tag = f"{source}#{n}:{kind}"
                template = templates[zlib.crc32(tag.encode()) % len(templates)]
                rows.append({"instruction": template.format(passage=passage, subject=subject), "category": kind,
                             "source": tag})
    return _order(rows)


# ----------------------------------------------------------------------------- files

SETS = ("code-stdlib", "code-topics", "context")
FILES = {"code-stdlib": ("code_stdlib_train.jsonl", "code_heldout.jsonl"), "code-topics": ("code_topics.jsonl",),
         "context": ("context_tasks.jsonl",)}
META_FILE = "prompt_sets.json"


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def check_sets(sets: tuple[str, ...]) -> None:
    unknown = [s for s in sets if s not in SETS]
    if unknown:
        raise ValueError(f"unknown prompt set(s) {unknown}; expected some of {SETS}")


def build(out_dir: str | Path, sets: tuple[str, ...] = SETS) -> dict[str, Any]:
    """Writes the prompt files of `sets` into `out_dir` -> meta (also written as prompt_sets.json):
    {"python": "3.11", "rows": {file: count}, "stdlib_modules": [...], "heldout_modules": [...]}."""
    check_sets(sets)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {"python": f"{sys.version_info.major}.{sys.version_info.minor}", "rows": {}}
    if "code-stdlib" in sets:
        rows, found = stdlib_tasks()
        train, held = split_stdlib(rows)
        for name, part in zip(FILES["code-stdlib"], (train, held)):
            _write_jsonl(out / name, part)
            meta["rows"][name] = len(part)
        meta["stdlib_modules"] = found
        meta["heldout_modules"] = [m for m in HELDOUT_MODULES if m in found]
    if "code-topics" in sets:
        rows = topic_tasks()
        _write_jsonl(out / FILES["code-topics"][0], rows)
        meta["rows"][FILES["code-topics"][0]] = len(rows)
    if "context" in sets:
        rows = context_tasks()
        _write_jsonl(out / FILES["context"][0], rows)
        meta["rows"][FILES["context"][0]] = len(rows)
    atomic_write_text(out / META_FILE, json.dumps(meta, indent=2) + "\n")
    return meta
