"""`mantra data`: corpus tools (trainer/data/corpus/), each with a progress bar on a terminal and a one-line summary.

    mantra data tokenize IN... --out FILE.bin [--field text] [--tokenizer tokenizer.json] [--workers N]
    mantra data dedup IN... --out OUT.jsonl [--field text] [--exact] [--threshold 0.8]
    mantra data inspect FILE.bin [--plot FILE.png]

IN is a .jsonl, .parquet, .arrow or text file, a directory of them, a `datasets.save_to_disk` folder,
or a glob. `mantra tokenize` is an alias of `mantra data tokenize`. Bad input: one line naming the file
(and line), exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

EXIT_OK, EXIT_BAD_INPUT = 0, 2


def _guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Run a command; a CorpusError is one `error:` line and exit 2."""

    def run(args: argparse.Namespace) -> int:
        from trainer.data.corpus import CorpusError

        out = getattr(args, "out", None)
        try:
            if out is not None and os.path.lexists(out) and (Path(out).is_symlink() or not Path(out).is_file()):
                raise CorpusError(f"--out {out} exists and is not a regular file (a directory, a link or a device "
                                  "is never replaced); name a new file or a plain one to replace")
            return fn(args)
        except CorpusError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except BrokenPipeError:
            raise  # stdout's reader left: the pipes convention (trainer/report/pipes.py) ends quietly
        except OSError as exc:  # a read-only filesystem, a full disk, a directory where a file goes
            where = exc.filename or out
            print(f"error: {where}: {exc.strerror or exc}; choose an --out on a writable filesystem with room "
                  "(and inputs that can be read)", file=sys.stderr)
            return EXIT_BAD_INPUT

    return run


def _tokenize(args: argparse.Namespace) -> int:
    from trainer.data.corpus.tokenize import tokenize_corpus

    summary = tokenize_corpus(args.inputs, args.out, field=args.field, tokenizer=args.tokenizer,
                              workers=args.workers, dtype=args.dtype, eos=args.eos, skip_bad=args.skip_bad)
    print(summary.line())
    return EXIT_OK


def _dedup(args: argparse.Namespace) -> int:
    from trainer.data.corpus.dedup import Params, dedup_corpus

    params = Params(field=args.field, exact_only=args.exact, threshold=args.threshold, num_perm=args.num_perm,
                    ngram=args.ngram, char=args.char)
    summary = dedup_corpus(args.inputs, args.out, params=params, workers=args.workers, skip_bad=args.skip_bad)
    print(summary.line())
    return EXIT_OK


def _inspect(args: argparse.Namespace) -> int:
    from trainer.data.corpus.inspect import inspect_tokens, plot_lengths, report_lines

    found = inspect_tokens(args.file, tokenizer=args.tokenizer, dtype=args.dtype)
    lines = report_lines(found)
    if args.plot:
        lines[-1] += f"; lengths drawn in {plot_lengths(found, args.plot)}"
    print("\n".join(lines))
    return EXIT_OK


def _inputs(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="IN",
                   help="a .jsonl/.parquet/.arrow/text file, a directory of them, a datasets.save_to_disk folder, "
                        "or a glob")
    p.add_argument("--field", default="text", help="the text field of jsonl records / column of parquet (default text)")
    p.add_argument("--skip-bad", action="store_true",
                   help="leave out bad documents (counted, the first named) instead of stopping at the first")


def _workers(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help=f"worker processes (default 1; this machine has {os.cpu_count()} cores)")


def add_tokenize_arguments(p: argparse.ArgumentParser) -> None:
    """`data tokenize`'s arguments; `mantra tokenize` (the alias) takes the same."""
    _inputs(p)
    p.add_argument("--out", required=True, metavar="FILE.bin",
                   help="token ids (uint16/uint32), one EOS between documents; FILE.idx beside it indexes the documents")
    p.add_argument("--tokenizer", default="byte", help="'byte' (default; EOS is 0), a local tokenizer.json, or a Hugging Face model directory holding one")
    p.add_argument("--eos", metavar="TOKEN", help="the tokenizer.json's EOS token, when it is none of the usual names")
    p.add_argument("--dtype", choices=["uint16", "uint32"], help="token width; default: the smallest that fits")
    _workers(p)
    p.set_defaults(fn=_guarded(_tokenize))


def add_data_parser(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="corpus tools: tokenize, dedup, inspect",
                          description=__doc__.split("\n\n")[1] if __doc__ else None,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = data.add_subparsers(dest="data_command", metavar="COMMAND", required=True)
    add_tokenize_arguments(commands.add_parser(
        "tokenize", help="documents -> FILE.bin of token ids + FILE.idx, byte-identical for any --workers"))

    p = commands.add_parser("dedup", help="drop exact and near duplicates (MinHash LSH); OUT.jsonl + OUT.report.json")
    _inputs(p)
    p.add_argument("--out", required=True, metavar="OUT.jsonl",
                   help="the kept documents (jsonl lines as they were); OUT.report.json beside it lists the clusters")
    p.add_argument("--exact", action="store_true", help="exact duplicates only (equal text up to case and whitespace)")
    p.add_argument("--threshold", type=float, default=0.8,
                   help="Jaccard similarity of the shingle sets from which two documents are near duplicates (0.8)")
    p.add_argument("--ngram", type=int, default=5, help="shingle length in words (or characters with --char); 5")
    p.add_argument("--char", action="store_true", help="character n-gram shingles instead of word n-grams")
    p.add_argument("--num-perm", type=int, default=128, help="MinHash permutations (128); bands x rows follow")
    _workers(p)
    p.set_defaults(fn=_guarded(_dedup))

    p = commands.add_parser("inspect", help="a token file's tokens, documents, length histogram and a decoded sample")
    p.add_argument("file", metavar="FILE.bin", help="a token file (its FILE.idx beside it gives the documents)")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the document-length histogram (.png, .svg, .pdf)")
    p.add_argument("--tokenizer", help="decode the sample with this ('byte', a tokenizer.json or a model directory); default: the index's")
    p.add_argument("--dtype", choices=["uint16", "uint32"], help="token width of a .bin without index (default uint16)")
    p.set_defaults(fn=_guarded(_inspect))
