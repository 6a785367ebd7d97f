"""Fixtures of tests/prepare_text.rs: Hugging Face tokenizers of the four families users bring,
trained here (no model hub is reachable) on a small corpus, the corpus as text files, JSON
Lines and Parquet (snappy and zstd), and what the `tokenizers` library (the oracle) encodes
each document to.

  gpt2_style.json   byte-level BPE, no post-processor tokens: documents separated by
                    <|endoftext|> (GPT-2, Qwen2)
  llama3_style.json byte-level BPE whose post-processor prepends <|begin_of_text|> (Llama 3)
  bert_style.json   WordPiece, BERT's normalizer, [CLS] … [SEP] (BERT)
  t5_style.json     Unigram with Metaspace, </s> appended (T5, SentencePiece models)
  docs.jsonl        a document per line in "text", beside other fields; one blank line
  docs_snappy.parquet, docs_zstd.parquet   the same rows, column "text" among others, two
                    row groups
  doc_*.txt         three documents as files of their own
  docs_null.parquet three rows, the second's text null (an error case)
  expected.json     per tokenizer: the vocabulary size, each document's ids as
                    `Tokenizer.encode(text).ids` gives them (special tokens added), and the
                    end-of-text token prepare-data puts before each document where the
                    post-processor marks none (the first of SEPARATORS in the vocabulary)

Rerun with `make test-data` (or .venv-bench/bin/python export.py). The byte-level BPE files come
out byte-identical; the WordPiece and Unigram trainers order ties through hash maps, so those
two tokenizers (and their ids in expected.json) can differ between runs, each run consistent."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import tokenizers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

HERE = os.path.dirname(os.path.abspath(__file__))

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "Training on Kubernetes: a TrainingJob becomes MPI-launched worker pods, one rank each.",
    "  Leading spaces, trailing spaces   and\ttabs\tbetween words.  ",
    "Line one\nLine two\n\nA paragraph after a blank line.\n",
    "Numbers 3.14159, 2,718 and 1e-9; dates 2026-11-26; ids #4521 @rank0.",
    "Accents: café, naïve, façade, Ærøskøbing, São Paulo, Zürich.",
    "Unicode beyond Latin: 東京は日本の首都です。Привет, мир! Γειά σου κόσμε. مرحبا بالعالم",
    "Emoji 🚀🔥 and symbols ∑∫√∞ ≠ ≤ ≥ → ← ©®™",
    "CamelCaseWords and snake_case_words and kebab-case-words in code: fn main() { println!(\"hi\"); }",
    "Repeated repeated repeated words words words make merges merge.",
    "A gradient step: w ← w − η·∇L(w), with η = 3e-4 and β₁ = 0.9.",
    "",
    "x",
    "Mixed CASE Text With Capitals AND SHOUTING.",
    "tabs\tand\r\nwindows line endings\r\nhere",
] + [f"Document {k}: the loss falls from {10 - k / 3:.2f} as step {k * 100} trains rank {k % 4}." for k in range(24)]

# prepare::text::SEPARATORS.
SEPARATORS = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"]


def byte_level_bpe(prepend=None):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|begin_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(DOCS * 3, trainer)
    if prepend:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{prepend} $A", pair=f"{prepend} $A $B", special_tokens=[(prepend, tok.token_to_id(prepend))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def bert_style():
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=500, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False
    )
    tok.train_from_iterator(DOCS * 3, trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    # What a checkpoint's tokenizer.json often carries: truncation and padding for a model's
    # inputs, which prepare-data must not apply to a corpus.
    tok.enable_truncation(max_length=16)
    tok.enable_padding(length=16, pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]")
    return tok


def t5_style():
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(tokenizers.Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=300, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False
    )
    tok.train_from_iterator(DOCS * 3, trainer)
    eos = tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos)]
    )
    return tok


def write_inputs():
    with open(os.path.join(HERE, "docs.jsonl"), "w", encoding="utf-8") as f:
        for k, doc in enumerate(DOCS):
            f.write(json.dumps({"id": k, "text": doc, "meta": {"source": "export.py", "len": len(doc)}}) + "\n")
            if k == 5:
                f.write("\n")  # a blank line, which JSON Lines readers skip
    table = pa.table(
        {
            "id": pa.array(range(len(DOCS)), pa.int64()),
            "text": pa.array(DOCS, pa.string()),
            "score": pa.array([k / 7 for k in range(len(DOCS))], pa.float64()),
        }
    )
    for codec in ["snappy", "zstd"]:
        pq.write_table(table, os.path.join(HERE, f"docs_{codec}.parquet"), compression=codec, row_group_size=20)
    nulls = pa.table({"text": pa.array(["first", None, "third"], pa.string())})
    pq.write_table(nulls, os.path.join(HERE, "docs_null.parquet"))
    for k in range(3):
        with open(os.path.join(HERE, f"doc_{k}.txt"), "w", encoding="utf-8", newline="") as f:
            f.write(DOCS[k + 2])


def main():
    tokenizers_ = {
        "gpt2_style": byte_level_bpe(),
        "llama3_style": byte_level_bpe(prepend="<|begin_of_text|>"),
        "bert_style": bert_style(),
        "t5_style": t5_style(),
    }
    expected = {"tokenizersVersion": tokenizers.__version__, "documents": DOCS, "tokenizers": {}}
    for name, tok in tokenizers_.items():
        tok.save(os.path.join(HERE, f"{name}.json"))
        tok.no_truncation()
        tok.no_padding()
        ids = [tok.encode(doc).ids for doc in DOCS]
        marked = len(tok.encode("").ids) > 0
        separator = None if marked else next(tok.token_to_id(t) for t in SEPARATORS if tok.token_to_id(t) is not None)
        expected["tokenizers"][name] = {
            "vocabSize": tok.get_vocab_size(with_added_tokens=True),
            "separator": separator,
            "ids": ids,
        }
        print(f"{name}: vocab {tok.get_vocab_size()}, {sum(map(len, ids))} tokens")
    write_inputs()
    with open(os.path.join(HERE, "expected.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
