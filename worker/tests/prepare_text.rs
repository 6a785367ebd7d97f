//! `prepare-data` on text as users bring it, against the Hugging Face `tokenizers` library:
//! tests/data/hf_tokenizers/export.py trained tokenizers of the four families (byte-level BPE
//! with and without a begin-of-text post-processor, WordPiece with [CLS] … [SEP] and with the
//! truncation and padding a checkpoint carries, Unigram with Metaspace and </s>), wrote a corpus
//! as JSON Lines, Parquet (snappy, zstd) and text files, and recorded the ids
//! `Tokenizer.encode(text)` gives each document. The token shards prepare-data writes must hold
//! exactly those ids, document after document; bad input exits 2 or 3 naming the file and line
//! or row.

mod common;

use common::{scratch, stderr};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use tensorfleet_worker::data::tokens::{read_header, read_window, MAGIC_U32};

fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf_tokenizers")
}

fn prepare(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tensorfleet-worker"))
        .arg("prepare-data")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

/// Every token of the shards under `dir`, in file order, and their width in bytes.
fn shard_tokens(dir: &Path) -> (Vec<u32>, usize) {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    let (mut tokens, mut width) = (Vec::new(), 0);
    for f in files {
        let info = read_header(&f).unwrap();
        width = info.token_bytes;
        tokens.extend(read_window(&std::fs::File::open(&f).unwrap(), &info, 0, info.tokens).unwrap());
    }
    (tokens, width)
}

/// The ids of documents `docs`, each marked as its family is (the separator first, or the
/// post-processor's tokens already in the ids).
fn stream(t: &Value, docs: impl Iterator<Item = usize>) -> Vec<u32> {
    let ids = &t["ids"];
    let separator = t["separator"].as_u64().map(|s| s as u32);
    docs.flat_map(|d| {
        let doc: Vec<u32> = serde_json::from_value(ids[d].clone()).unwrap();
        separator.into_iter().chain(doc)
    })
    .collect()
}

#[test]
fn tokens_match_hugging_face_tokenizers_from_jsonl_parquet_and_text() {
    let (d, dir) = (data(), scratch("prepare-text-oracle"));
    let e: Value = serde_json::from_str(&std::fs::read_to_string(d.join("expected.json")).unwrap()).unwrap();
    let n = e["documents"].as_array().unwrap().len();
    let inputs = ["docs.jsonl", "docs_snappy.parquet", "docs_zstd.parquet", "doc_0.txt", "doc_1.txt", "doc_2.txt"];
    let inputs: Vec<String> = inputs.iter().map(|f| d.join(f).display().to_string()).collect();
    // The text files hold documents 2, 3 and 4.
    let order = || (0..n).chain(0..n).chain(0..n).chain(2..5);
    for (name, t) in e["tokenizers"].as_object().unwrap() {
        let tokenizer = d.join(format!("{name}.json")).display().to_string();
        let out = format!("out_{name}");
        let mut args = vec!["--tokenizer", &tokenizer, "--output", &out, "--val-fraction", "0", "--input"];
        args.extend(inputs.iter().map(String::as_str));
        let o = prepare(&args, &dir);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let (got, width) = shard_tokens(&dir.join(&out).join("train"));
        assert_eq!(width, 2, "{name}: a vocabulary of {} fits u16 shards", t["vocabSize"]);
        let want = stream(t, order());
        let first = got.iter().zip(&want).position(|(g, w)| g != w);
        assert!(
            got.len() == want.len() && first.is_none(),
            "{name}: {} tokens, the tokenizers library's {}; first difference at token {first:?}",
            got.len(),
            want.len()
        );
        println!("{name}: {} tokens equal to the tokenizers library's ({})", got.len(), e["tokenizersVersion"]);
    }
}

#[test]
fn validation_takes_the_first_tokens() {
    let (d, dir) = (data(), scratch("prepare-text-val"));
    let e: Value = serde_json::from_str(&std::fs::read_to_string(d.join("expected.json")).unwrap()).unwrap();
    let n = e["documents"].as_array().unwrap().len();
    let (input, tokenizer) = (d.join("docs.jsonl"), d.join("gpt2_style.json"));
    let o = prepare(
        &["--input", input.to_str().unwrap(), "--tokenizer", tokenizer.to_str().unwrap(), "--output", "out"],
        &dir,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let want = stream(&e["tokenizers"]["gpt2_style"], 0..n);
    let (val, _) = shard_tokens(&dir.join("out/val"));
    let (train, _) = shard_tokens(&dir.join("out/train"));
    assert_eq!(val.len(), (want.len() as f64 * 0.1).round() as usize, "the default --val-fraction is 0.1");
    assert_eq!([val, train].concat(), want);
}

/// A word-level tokenizer.json of `words` words w0, w1, …, with `<|endoftext|>` after them
/// where `separator`.
fn word_level(words: usize, separator: bool) -> String {
    let mut vocab: serde_json::Map<String, Value> = (0..words).map(|k| (format!("w{k}"), Value::from(k))).collect();
    vocab.insert("[UNK]".into(), Value::from(words));
    let added = match separator {
        true => serde_json::json!([{"id": words + 1, "content": "<|endoftext|>", "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}]),
        false => serde_json::json!([]),
    };
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    })
    .to_string()
}

#[test]
fn vocabularies_past_65536_write_u32_shards() {
    let dir = scratch("prepare-text-wide");
    std::fs::write(dir.join("wide.json"), word_level(70_000, true)).unwrap();
    std::fs::write(dir.join("a.txt"), "w69999 w3 w65536 nope").unwrap();
    let o = prepare(&["--input", "a.txt", "--tokenizer", "wide.json", "--output", "out", "--val-fraction", "0"], &dir);
    assert!(o.status.success(), "{}", stderr(&o));
    let shard = dir.join("out/train/train_000000.bin");
    assert_eq!(i32::from_le_bytes(std::fs::read(&shard).unwrap()[..4].try_into().unwrap()), MAGIC_U32);
    assert_eq!(shard_tokens(&dir.join("out/train")), (vec![70_001, 69_999, 3, 65_536, 70_000], 4));
}

/// What a user gets wrong, or brings damaged: exit 2 (fix the arguments or the data) or 3
/// (unreadable), the message naming the file and line or row, and no output written.
#[test]
fn bad_input_names_the_file_and_line_or_row() {
    let (d, dir) = (data(), scratch("prepare-text-bad"));
    let gpt2_style = d.join("gpt2_style.json").display().to_string();
    std::fs::write(dir.join("bad.jsonl"), "{\"text\": \"fine\"}\n\n{\"text\": \"cut\n").unwrap();
    std::fs::write(dir.join("field.jsonl"), "{\"text\": \"fine\"}\n{\"body\": \"x\", \"id\": 2}\n").unwrap();
    std::fs::write(dir.join("number.jsonl"), "{\"text\": 7}\n").unwrap();
    std::fs::write(dir.join("array.jsonl"), "[\"text\"]\n").unwrap();
    std::fs::write(dir.join("latin1.txt"), b"caf\xe9 au lait").unwrap();
    std::fs::write(dir.join("garbage.json"), "{\"model\": 12}").unwrap();
    std::fs::write(dir.join("plain.json"), word_level(10, false)).unwrap();
    let parquet = std::fs::read(d.join("docs_snappy.parquet")).unwrap();
    std::fs::write(dir.join("cut.parquet"), &parquet[..parquet.len() / 2]).unwrap();
    let snappy = d.join("docs_snappy.parquet").display().to_string();
    let nulls = d.join("docs_null.parquet").display().to_string();
    // Inputs on which the decoders panicked (exit 101), found by tests/fuzz.rs: a Parquet file
    // whose metadata gives a column a negative offset, a tokenizer.json with a malformed decoder.
    let fuzz = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/fuzz");
    std::fs::copy(fuzz.join("parquet/682de61014ace65b"), dir.join("offsets.parquet")).unwrap();
    std::fs::copy(fuzz.join("tokenizer/6c0e5e9e4a7ca960"), dir.join("decoder.json")).unwrap();
    let cases: [(&[&str], i32, &[&str]); 13] = [
        (&["--input", "bad.jsonl"], 3, &["bad.jsonl line 3", "JSON"]),
        (&["--input", "field.jsonl"], 2, &["field.jsonl line 2", "no \"text\" field", "body, id", "--text-field"]),
        (&["--input", "number.jsonl"], 2, &["number.jsonl line 1", "\"text\" is a JSON number"]),
        (&["--input", "array.jsonl"], 3, &["array.jsonl line 1", "a JSON array"]),
        (&["--input", "latin1.txt"], 3, &["latin1.txt", "not UTF-8", "byte offset 3"]),
        (
            &["--input", &snappy, "--text-field", "body"],
            2,
            &["docs_snappy.parquet", "no column \"body\"", "id, text, score"],
        ),
        (&["--input", &snappy, "--text-field", "id"], 2, &["docs_snappy.parquet", "column \"id\" does not hold text"]),
        (&["--input", &nulls], 2, &["docs_null.parquet row 1", "null"]),
        (&["--input", "cut.parquet"], 3, &["cut.parquet", "not a Parquet file"]),
        (&["--input", "missing.txt"], 2, &["--input missing.txt"]),
        (&["--input", "latin1.txt", "--tokenizer", "garbage.json"], 3, &["--tokenizer garbage.json", "tokenizer.json"]),
        (&["--input", "offsets.parquet"], 3, &["offsets.parquet", "decoder gave up", "damaged"]),
        (
            &["--input", "latin1.txt", "--tokenizer", "decoder.json"],
            3,
            &["--tokenizer decoder.json", "decoder gave up"],
        ),
    ];
    for (args, code, needles) in cases {
        let mut all = args.to_vec();
        if !args.contains(&"--tokenizer") {
            all.extend(["--tokenizer", &gpt2_style]);
        }
        all.extend(["--output", "out"]);
        let o = prepare(&all, &dir);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(code), "{args:?}: {err}");
        for needle in needles {
            assert!(err.contains(needle), "{args:?}: the message names {needle:?}: {err}");
        }
        assert!(!dir.join("out").exists(), "{args:?}: nothing is written");
    }
    let o = prepare(&["--input", "latin1.txt", "--tokenizer", "missing.json", "--output", "out"], &dir);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let o = prepare(&["--input", "number.jsonl", "--tokenizer", "plain.json", "--output", "out"], &dir);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("adds no special tokens") && stderr(&o).contains("<|endoftext|>"), "{}", stderr(&o));
}

/// A vocabulary's size counts its entries; ids can lie past that count (a tokenizer.json with
/// gaps): shards are u32 as soon as an id needs it, never truncated to u16.
#[test]
fn ids_past_65535_in_a_small_vocabulary_write_u32_shards() {
    let dir = scratch("prepare-text-gaps");
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 3, "content": "<|endoftext|>", "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"a": 0, "far": 80_000, "[UNK]": 1}, "unk_token": "[UNK]"}
    });
    std::fs::write(dir.join("gaps.json"), tokenizer.to_string()).unwrap();
    std::fs::write(dir.join("a.txt"), "a far b").unwrap();
    let o = prepare(&["--input", "a.txt", "--tokenizer", "gaps.json", "--output", "out", "--val-fraction", "0"], &dir);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(shard_tokens(&dir.join("out/train")), (vec![3, 0, 80_000, 1], 4));
}

/// A second run into the same folder replaces the first's shards (a larger corpus's extra
/// shards and its val/ would otherwise be read with them); no documents at all is exit 2.
#[test]
fn a_rerun_replaces_the_shards_and_nothing_to_tokenize_is_refused() {
    let dir = scratch("prepare-text-rerun");
    std::fs::create_dir_all(dir.join("out/train")).unwrap();
    std::fs::create_dir_all(dir.join("out/val")).unwrap();
    std::fs::write(dir.join("out/train/train_000007.bin"), b"an earlier run's").unwrap();
    std::fs::write(dir.join("out/val/val_000000.bin"), b"an earlier run's").unwrap();
    std::fs::write(dir.join("a.txt"), "some text").unwrap();
    let o = prepare(&["--input", "a.txt", "--output", "out", "--val-fraction", "0"], &dir);
    assert!(o.status.success(), "{}", stderr(&o));
    let names = |d: &str| -> Vec<String> {
        let mut n: Vec<String> =
            std::fs::read_dir(dir.join(d)).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
        n.sort();
        n
    };
    assert_eq!(names("out/train"), ["train_000000.bin"]);
    assert!(names("out/val").is_empty());
    std::fs::write(dir.join("empty.jsonl"), "\n\n").unwrap();
    let o = prepare(&["--input", "empty.jsonl", "--output", "out2"], &dir);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("no documents"), "{}", stderr(&o));
}
