"""Prompt sets built offline: code tasks from the Python standard library and seed topics,
long-context tasks over the standard library's own prose, and prompts the target writes itself.

Four sources, each written as JSONL rows with the fields the loaders read (`instruction`,
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
* **seeds**, then **derived**: `CHAT_TOPICS` x `CHAT_SEED_INSTRUCTIONS` ask the target to write a
  question or request a user might give an assistant, and one prompt per topic asks it for German
  sentences (seed_tasks.jsonl). `dflash-jax decode` answers them; `build_derived` turns the
  answers into prompts (derived_tasks.jsonl): the chat ones as they are, the German ones as
  "Translate German to English" prompts. The chat data then reaches beyond alpaca_eval's 805
  prompts, and translation (spec_bench's category with the lowest acceptance) gets any data.

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
from dflash_jax.jsonl import iter_jsonl

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

def _stdlib_module(name: str) -> Any | None:
    """The module `name`, or None where this interpreter's build lacks it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a deprecation notice is no reason to leave a module out
        try:
            return importlib.import_module(name)
        except ImportError:
            return None


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
        module = _stdlib_module(module_name)
        if module is None:
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
        module = _stdlib_module(module_name)
        if module is None:
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


# ----------------------------------------------------------------------------- target-written prompts

# Everyday, academic and practical subjects for prompts the target writes itself (my own list).
CHAT_TOPICS = (
    "saving money on groceries", "learning a second language", "training for a first marathon",
    "keeping houseplants alive", "planning a week of healthy dinners", "writing a cover letter",
    "negotiating a salary", "preparing for a job interview", "starting a small online shop",
    "renting a first apartment", "moving to another city", "raising a puppy", "caring for an old cat",
    "teaching a child to read", "helping a teenager with homework", "planning a birthday party",
    "organising a wedding on a budget", "a weekend trip to the mountains", "packing light for travel",
    "jet lag", "camping in the rain", "fixing a leaking tap", "painting a room", "composting at home",
    "growing tomatoes on a balcony", "baking sourdough bread", "brewing good coffee", "vegetarian cooking",
    "food allergies", "sleep habits", "stress at work", "time management", "procrastination",
    "public speaking", "making friends as an adult", "resolving an argument with a roommate",
    "writing a thank-you note", "choosing a laptop", "protecting passwords", "backing up photos",
    "spotting phishing emails", "electric cars", "solar panels on a house", "recycling plastics",
    "climate change", "ocean currents", "volcanoes", "earthquakes", "the water cycle", "photosynthesis",
    "the human immune system", "vaccines", "how the heart pumps blood", "the brain and memory",
    "black holes", "the phases of the moon", "the planets of the solar system", "how rainbows form",
    "why the sky is blue", "the theory of evolution", "DNA and genes", "antibiotic resistance",
    "the Roman Empire", "ancient Egypt", "the printing press", "the Industrial Revolution",
    "the French Revolution", "the history of the internet", "the Silk Road", "the Renaissance",
    "world religions", "democracy and voting systems", "how a bill becomes law", "inflation",
    "interest rates", "the stock market", "supply and demand", "unemployment", "international trade",
    "personal budgeting", "credit scores", "insurance", "buying a used car", "philosophy of free will",
    "ethics of artificial intelligence", "the trolley problem", "utilitarianism", "stoicism",
    "poetry", "writing a short story", "famous novels", "Shakespeare's plays", "film history",
    "jazz music", "learning the guitar", "classical composers", "drawing portraits", "photography basics",
    "chess strategy", "the rules of football", "the Olympic Games", "yoga for beginners",
    "strength training", "nutrition for athletes", "first aid", "mental health", "meditation",
    "children's sleep", "elderly parents", "volunteering", "community gardens", "city planning",
    "public transport", "bicycles in cities", "architecture styles", "bridges and how they stand",
    "how airplanes fly", "rockets and space travel", "smartphones and batteries", "how search engines work",
    "machine learning", "data privacy", "social media and teenagers", "video games and learning",
    "remote work", "running a meeting", "giving feedback to a colleague", "starting a podcast",
    "writing a speech for a friend", "a letter of complaint", "a product review", "a travel blog post",
    "a news summary", "a recipe for a picnic", "a science fair project", "a museum visit",
    "logic puzzles", "probability in games of chance", "geometry in everyday life", "statistics in the news",
)

CHAT_SEED_INSTRUCTIONS = (
    "Write one question that a curious person might ask an AI assistant about {topic}. Reply with the "
    "question only.",
    "Write a request that a user could give an AI assistant about {topic}: a writing, planning or "
    "explanation task with one or two details. Reply with the request only.",
    "Write a short reasoning question about {topic} that needs a few steps of thought to answer. Reply "
    "with the question only.",
)
GERMAN_SEED_INSTRUCTION = "Write two short sentences in German about {topic}. Reply with the German only."
# The stage-two prompt for a German answer, as translation prompts are usually put.
TRANSLATE_INSTRUCTION = "Translate German to English: {text}"
# Copies of each seed: decoded at T > 0 they give different prompts.
SEED_COPIES = 3
# Answers shorter than this are no prompt; longer ones were rambling past the request.
MIN_DERIVED_CHARS = 15
MAX_DERIVED_CHARS = 1200


def seed_tasks() -> list[dict[str, Any]]:
    """Prompts that ask the target to write prompts (stage one): CHAT_TOPICS x CHAT_SEED_INSTRUCTIONS
    (category "seed-chat") and one German passage per topic (category "seed-german"), each
    SEED_COPIES times (the last field of "source" counts the copies), in CRC-32 order. Rows carry
    the text as "prompt" too, the field `dflash-jax decode` reads."""
    rows = [{"category": "seed-chat", "source": f"seed-chat:{i}:{j}:{k}", "text": template.format(topic=topic)}
            for i, topic in enumerate(CHAT_TOPICS) for j, template in enumerate(CHAT_SEED_INSTRUCTIONS)
            for k in range(SEED_COPIES)]
    rows += [{"category": "seed-german", "source": f"seed-german:{i}:{k}",
              "text": GERMAN_SEED_INSTRUCTION.format(topic=topic)}
             for i, topic in enumerate(CHAT_TOPICS) for k in range(SEED_COPIES)]
    return _order([{"instruction": r["text"], "prompt": r["text"], "category": r["category"], "source": r["source"]}
                   for r in rows])


def _clean_answer(text: str) -> str | None:
    """An answer as a prompt: its first paragraph, without surrounding quotes or a "Question:"-like
    label; None when that is shorter than MIN_DERIVED_CHARS or longer than MAX_DERIVED_CHARS."""
    text = text.strip().split("\n\n", 1)[0].strip()
    for label in ("Question:", "Request:", "Puzzle:", "German:", "Deutsch:"):
        if text.startswith(label):
            text = text[len(label):].strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1].strip()
    return text if MIN_DERIVED_CHARS <= len(text) <= MAX_DERIVED_CHARS else None


def derived_tasks(answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stage two: the target's answers to `seed_tasks` (rows of a `dflash-jax decode` output, with
    their "category", "source" and "text") as training prompts: a chat answer is itself the prompt
    (category "chat"), a German answer becomes TRANSLATE_INSTRUCTION (category "translation").
    Unusable answers (`_clean_answer`) and repeated prompts are dropped; CRC-32 order."""
    rows, seen = [], set()
    for answer in answers:
        kind, text = answer.get("category"), answer.get("text")
        if kind not in ("seed-chat", "seed-german") or not isinstance(text, str):
            continue
        text = _clean_answer(text)
        if text is None:
            continue
        instruction = text if kind == "seed-chat" else TRANSLATE_INSTRUCTION.format(text=text)
        if instruction in seen:
            continue
        seen.add(instruction)
        rows.append({"instruction": instruction, "category": "chat" if kind == "seed-chat" else "translation",
                     "source": f"derived:{answer.get('source')}"})
    return _order(rows)


# ----------------------------------------------------------------------------- files

SETS = ("code-stdlib", "code-topics", "context", "seeds")
FILES = {"code-stdlib": ("code_stdlib_train.jsonl", "code_heldout.jsonl"), "code-topics": ("code_topics.jsonl",),
         "context": ("context_tasks.jsonl",), "seeds": ("seed_tasks.jsonl",)}
# Built from a decode of seed_tasks.jsonl (`build_derived`), not by `build`.
DERIVED_FILE = "derived_tasks.jsonl"
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
    if "seeds" in sets:
        rows = seed_tasks()
        _write_jsonl(out / FILES["seeds"][0], rows)
        meta["rows"][FILES["seeds"][0]] = len(rows)
    atomic_write_text(out / META_FILE, json.dumps(meta, indent=2) + "\n")
    return meta


def build_derived(answers_path: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """`derived_tasks` of a decode output file into OUT/derived_tasks.jsonl; its row count joins
    OUT/prompt_sets.json (made there by `build`, or made here). -> that meta."""
    answers = [row for _, row in iter_jsonl(answers_path)]
    rows = derived_tasks(answers)
    if not rows:
        raise ValueError(f"{answers_path}: no usable answers to seed prompts (rows with category seed-chat or "
                         f"seed-german and a text of {MIN_DERIVED_CHARS}-{MAX_DERIVED_CHARS} characters)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / DERIVED_FILE, rows)
    meta_path = out / META_FILE
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"rows": {}}
    meta["rows"][DERIVED_FILE] = len(rows)
    meta["derived_from"] = {"answers": len(answers), "chat": sum(r["category"] == "chat" for r in rows),
                            "translation": sum(r["category"] == "translation" for r in rows)}
    atomic_write_text(meta_path, json.dumps(meta, indent=2) + "\n")
    return meta
