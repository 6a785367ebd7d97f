//! Text → llm.c token shards, split into `train/` (the tokens after the first `val_fraction`)
//! and `val/` (those first tokens).
//!
//! Inputs are read by their extension: `.jsonl`, `.ndjson` and `.json` as JSON Lines (a document
//! per line, its text in `text_field`; blank lines skipped), `.parquet` as Parquet (a document
//! per row, its text in the `text_field` column), anything else as one plain-text document.
//!
//! Tokenizers: GPT-2's BPE (built in), or a Hugging Face `tokenizer.json` of any model family,
//! applied as `Tokenizer.encode(text)` applies it in Python: normalizer, pre-tokenizer, model
//! and post-processor, without the truncation or padding a checkpoint's tokenizer.json may
//! carry. Documents are kept apart as the model family expects: where the post-processor adds
//! special tokens (Llama's begin-of-text, BERT's [CLS] … [SEP], T5's </s>) they do; otherwise
//! an end-of-text token goes before each document, as llm.c's GPT-2 shards have it.
//! Vocabularies up to 65,536 tokens are written as u16 shards, larger ones as u32.

use super::progress;
use crate::data::tokens::{write_shard, ShardToken};
use crate::error::{Error, Result};
use indicatif::ProgressBar;
use rayon::prelude::*;
use serde_json::Value;
use std::io::BufRead;
use std::path::{Path, PathBuf};

/// GPT-2's `<|endoftext|>`.
pub const END_OF_TEXT: u32 = 50256;
/// Tokens per shard file (llm.c's default shard size).
pub const SHARD_TOKENS: usize = 100_000_000;
/// The end-of-text tokens looked for, in this order, to separate documents where a
/// tokenizer.json's post-processor adds no special tokens.
pub const SEPARATORS: [&str; 4] = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"];
/// Documents are tokenized in batches of about this many bytes of text (in parallel).
const BATCH_BYTES: usize = 8 << 20;

/// What `prepare_text` tokenizes with, and where the text is.
#[derive(Clone, Debug)]
pub struct TextOptions {
    /// `gpt2` or the path of a tokenizer.json.
    pub tokenizer: String,
    /// The JSON field or Parquet column of each document's text.
    pub text_field: String,
    pub val_fraction: f64,
}

/// A tokenizer, and how documents are kept apart in its token stream.
enum Tokenizer {
    Gpt2(tiktoken_rs::CoreBPE),
    HuggingFace {
        inner: Box<tokenizers::Tokenizer>,
        /// The token put before each document; None where the post-processor marks documents.
        separator: Option<u32>,
    },
}

impl Tokenizer {
    fn load(spec: &str) -> Result<Self> {
        if spec == "gpt2" {
            let bpe = tiktoken_rs::r50k_base().map_err(|e| Error::Runtime(format!("loading the GPT-2 BPE: {e}")))?;
            return Ok(Tokenizer::Gpt2(bpe));
        }
        let bytes =
            crate::files::read_input(Path::new(spec)).map_err(|e| Error::Config(format!("--tokenizer {spec}: {e}")))?;
        let (inner, marked) = super::refusing_panics(&format!("--tokenizer {spec}"), || {
            let mut inner = tokenizers::Tokenizer::from_bytes(&bytes)
                .map_err(|e| Error::Corrupt(format!("--tokenizer {spec}: not a Hugging Face tokenizer.json: {e}")))?;
            inner
                .with_truncation(None)
                .map_err(|e| Error::Config(format!("--tokenizer {spec}: turning its truncation off: {e}")))?;
            inner.with_padding(None);
            let marked = !inner
                .encode("", true)
                .map_err(|e| Error::Config(format!("--tokenizer {spec}: encoding an empty document: {e}")))?
                .get_ids()
                .is_empty();
            Ok((inner, marked))
        })?;
        let separator = match marked {
            true => None,
            false => Some(SEPARATORS.iter().find_map(|t| inner.token_to_id(t)).ok_or_else(|| {
                Error::Config(format!(
                    "--tokenizer {spec}: its post-processor adds no special tokens and it has none of {} \
                     to put between documents",
                    SEPARATORS.join(", ")
                ))
            })?),
        };
        Ok(Tokenizer::HuggingFace { inner: Box::new(inner), separator })
    }

    fn vocab_size(&self) -> usize {
        match self {
            // r50k_base: 50,256 merges and <|endoftext|>.
            Tokenizer::Gpt2(_) => END_OF_TEXT as usize + 1,
            Tokenizer::HuggingFace { inner, .. } => inner.get_vocab_size(true),
        }
    }

    fn describe(&self, spec: &str) -> String {
        let how = match self {
            Tokenizer::Gpt2(_) => format!("<|endoftext|> ({END_OF_TEXT}) before each document"),
            Tokenizer::HuggingFace { separator: None, .. } => "its post-processor's special tokens".into(),
            Tokenizer::HuggingFace { inner, separator: Some(id) } => {
                format!("{} ({id}) before each document", inner.id_to_token(*id).unwrap_or_default())
            }
        };
        format!("tokenizer {spec}: {} tokens; documents kept apart by {how}", self.vocab_size())
    }

    /// The tokens of `docs`, in order, each document marked as the family expects.
    fn encode(&self, docs: &[String], origin: &str) -> Result<Vec<u32>> {
        let per_doc: Vec<Vec<u32>> = match self {
            Tokenizer::Gpt2(bpe) => {
                docs.par_iter().map(|d| std::iter::once(END_OF_TEXT).chain(bpe.encode_ordinary(d)).collect()).collect()
            }
            Tokenizer::HuggingFace { inner, separator } => {
                let refs: Vec<&str> = docs.iter().map(String::as_str).collect();
                let encodings = super::refusing_panics(origin, || {
                    inner
                        .encode_batch(refs, separator.is_none())
                        .map_err(|e| Error::Config(format!("{origin}: tokenizing: {e}")))
                })?;
                encodings.iter().map(|e| separator.iter().chain(e.get_ids()).copied().collect()).collect()
            }
        };
        Ok(per_doc.concat())
    }
}

/// The token stream of every input, tokenized batch by batch with a progress bar over the
/// inputs' bytes.
struct Stream<'a> {
    tokenizer: &'a Tokenizer,
    tokens: Vec<u32>,
    batch: Vec<String>,
    batch_bytes: usize,
    documents: usize,
    bar: ProgressBar,
}

impl Stream<'_> {
    fn push(&mut self, doc: String, origin: &dyn Fn() -> String) -> Result<()> {
        self.batch_bytes += doc.len();
        self.batch.push(doc);
        if self.batch_bytes >= BATCH_BYTES {
            self.flush(&origin())?;
        }
        Ok(())
    }

    fn flush(&mut self, origin: &str) -> Result<()> {
        let docs = std::mem::take(&mut self.batch);
        self.tokens.extend(self.tokenizer.encode(&docs, origin)?);
        self.documents += docs.len();
        self.batch_bytes = 0;
        Ok(())
    }
}

pub fn prepare_text(inputs: &[PathBuf], output: &Path, opts: &TextOptions) -> Result<()> {
    let tokenizer = Tokenizer::load(&opts.tokenizer)?;
    eprintln!("{}", tokenizer.describe(&opts.tokenizer));
    let sizes = inputs
        .iter()
        .map(|p| {
            let file = crate::files::open_input(p);
            file.and_then(|f| f.metadata())
                .map(|m| m.len())
                .map_err(|e| Error::Config(format!("--input {}: {e}", p.display())))
        })
        .collect::<Result<Vec<u64>>>()?;
    let bar = progress(sizes.iter().sum(), "bytes");
    let mut stream =
        Stream { tokenizer: &tokenizer, tokens: Vec::new(), batch: Vec::new(), batch_bytes: 0, documents: 0, bar };
    for (i, (path, size)) in inputs.iter().zip(&sizes).enumerate() {
        let (documents, tokens, start) = (stream.documents, stream.tokens.len(), stream.bar.position());
        stream.bar.set_message(path.display().to_string());
        read_documents(path, &opts.text_field, &mut stream)?;
        stream.flush(&path.display().to_string())?;
        stream.bar.set_position(start + size);
        let (docs, toks) = (stream.documents - documents, stream.tokens.len() - tokens);
        let line = format!("[{}/{}] {}: {docs} documents, {toks} tokens", i + 1, inputs.len(), path.display());
        stream.bar.suspend(|| eprintln!("{line}"));
    }
    stream.bar.finish_and_clear();
    let tokens = stream.tokens;
    if stream.documents == 0 {
        return Err(Error::Config(format!("--input: no documents in {} input(s), nothing to tokenize", inputs.len())));
    }
    let n_val = ((tokens.len() as f64) * opts.val_fraction).round() as usize;
    let (val, train) = tokens.split_at(n_val);
    // u16 shards where every id fits: a vocabulary's size counts its entries, and a
    // tokenizer.json with gaps or high added-token ids can give larger ids than that count.
    let wide = tokenizer.vocab_size() > 1 << 16 || tokens.iter().any(|&t| t > u16::MAX as u32);
    for (split, part) in [("train", train), ("val", val)] {
        let dir = output.join(split);
        if part.is_empty() && split == "val" {
            super::remove_stale_shards(&dir, split, "bin", 0)?;
            continue;
        }
        let files = match wide {
            true => write_split(&dir, split, part)?,
            false => write_split(&dir, split, &part.iter().map(|&t| t as u16).collect::<Vec<_>>())?,
        };
        let width = if wide { "u32" } else { "u16" };
        println!("{split}: {} {width} tokens in {} shard(s) under {}", part.len(), files.len(), dir.display());
    }
    Ok(())
}

fn write_split<T: ShardToken>(dir: &Path, prefix: &str, tokens: &[T]) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|e| Error::Runtime(format!("{}: {e}", dir.display())))?;
    let mut files = Vec::new();
    for (i, chunk) in tokens.chunks(SHARD_TOKENS).enumerate() {
        let p = dir.join(format!("{prefix}_{i:06}.bin"));
        write_shard(&p, chunk)?;
        files.push(p);
    }
    super::remove_stale_shards(dir, prefix, "bin", files.len())?;
    Ok(files)
}

/// Feeds the documents of one input to `stream`, as its extension says it holds them.
fn read_documents(path: &Path, field: &str, stream: &mut Stream) -> Result<()> {
    let extension = path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
    match extension.as_deref() {
        Some("jsonl" | "ndjson" | "json") => json_lines(path, field, stream),
        Some("parquet") => super::refusing_panics(&path.display().to_string(), || parquet_rows(path, field, stream)),
        _ => {
            let bytes = crate::files::read_input(path)
                .map_err(|e| Error::Config(format!("--input {}: {e}", path.display())))?;
            let text = String::from_utf8(bytes).map_err(|e| {
                let at = e.utf8_error().valid_up_to();
                Error::Corrupt(format!("{}: not UTF-8 text (byte offset {at})", path.display()))
            })?;
            stream.push(text, &|| path.display().to_string())
        }
    }
}

fn json_lines(path: &Path, field: &str, stream: &mut Stream) -> Result<()> {
    let file = crate::files::open_input(path).map_err(|e| Error::Config(format!("--input {}: {e}", path.display())))?;
    let mut reader = std::io::BufReader::new(file);
    let mut line = String::new();
    for number in 1.. {
        line.clear();
        let at = |what: String| format!("{} line {number}: {what}", path.display());
        let read = reader.read_line(&mut line).map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidData => Error::Corrupt(at("not UTF-8".into())),
            _ => Error::Runtime(at(e.to_string())),
        })?;
        if read == 0 {
            return Ok(());
        }
        stream.bar.inc(read as u64);
        if line.trim().is_empty() {
            continue;
        }
        let value: Value =
            serde_json::from_str(&line).map_err(|e| Error::Corrupt(at(format!("not a line of JSON Lines: {e}"))))?;
        let Value::Object(fields) = value else {
            return Err(Error::Corrupt(at(format!("a JSON {}, not an object with a \"{field}\" field", kind(&value)))));
        };
        let text = match fields.get(field) {
            Some(Value::String(text)) => text.clone(),
            Some(other) => {
                return Err(Error::Config(at(format!("\"{field}\" is a JSON {}, not a string", kind(other)))));
            }
            None => {
                let names: Vec<&str> = fields.keys().map(String::as_str).collect();
                return Err(Error::Config(at(format!(
                    "no \"{field}\" field (it has {}); --text-field names the field that holds the text",
                    names.join(", ")
                ))));
            }
        };
        stream.push(text, &|| format!("{} line {number}", path.display()))?;
    }
    unreachable!("the lines end")
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn parquet_rows(path: &Path, column: &str, stream: &mut Stream) -> Result<()> {
    use parquet::basic::{ConvertedType, LogicalType, Type as Physical};
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::Field;
    let file = crate::files::open_input(path).map_err(|e| Error::Config(format!("--input {}: {e}", path.display())))?;
    let corrupt = |what: String| Error::Corrupt(format!("{}: {what}", path.display()));
    let reader = SerializedFileReader::new(file).map_err(|e| corrupt(format!("not a Parquet file: {e}")))?;
    let schema = reader.metadata().file_metadata().schema();
    let fields = schema.get_fields();
    let Some(text) = fields.iter().find(|f| f.name() == column) else {
        let names: Vec<&str> = fields.iter().map(|f| f.name()).collect();
        return Err(Error::Config(format!(
            "{}: no column \"{column}\" (it has {}); --text-field names the column that holds the text",
            path.display(),
            names.join(", ")
        )));
    };
    let info = text.get_basic_info();
    let is_text = text.is_primitive()
        && text.get_physical_type() == Physical::BYTE_ARRAY
        && (matches!(info.logical_type_ref(), Some(LogicalType::String))
            || info.converted_type() == ConvertedType::UTF8);
    if !is_text {
        return Err(Error::Config(format!("{}: column \"{column}\" does not hold text (strings)", path.display())));
    }
    let projection = parquet::schema::types::Type::group_type_builder(schema.name())
        .with_fields(vec![text.clone()])
        .build()
        .map_err(|e| corrupt(e.to_string()))?;
    let mut row = 0usize;
    for g in 0..reader.num_row_groups() {
        let group = reader.get_row_group(g).map_err(|e| corrupt(format!("row group {g}: {e}")))?;
        let rows = group.get_row_iter(Some(projection.clone())).map_err(|e| corrupt(format!("row group {g}: {e}")))?;
        for r in rows {
            let at = |what: String| format!("{} row {row}: {what}", path.display());
            let r = r.map_err(|e| Error::Corrupt(at(e.to_string())))?;
            match r.get_column_iter().next().map(|(_, f)| f) {
                Some(Field::Str(s)) => stream.push(s.clone(), &|| format!("{} row {row}", path.display()))?,
                Some(Field::Null) => {
                    return Err(Error::Config(at(format!("\"{column}\" is null; drop or fill such rows first"))))
                }
                other => return Err(Error::Corrupt(at(format!("\"{column}\" holds {other:?}, not a string")))),
            }
            row += 1;
        }
        stream.bar.inc(group.metadata().compressed_size().max(0) as u64);
    }
    Ok(())
}
