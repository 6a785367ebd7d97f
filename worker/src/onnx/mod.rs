//! ONNX models: the protobuf messages ([`proto`]), reading and writing `.onnx` files with their
//! external data, and conversion between `TensorProto` and the engine's
//! [`Tensor`](crate::tensor::Tensor) ([`tensor`]).
//!
//! A model that loads has been checked as far as this module can without knowing operators:
//! a supported IR version and default-domain opset, a graph, and every tensor's data present and
//! the size its dims and element type call for. Errors name the file and the tensor, node or
//! field at fault, so a user can find it in Netron; all of them are [`Error::Corrupt`] except a
//! model file that cannot be opened ([`Error::Config`]) and I/O failures ([`Error::Runtime`]).

pub mod functions;
pub mod proto;
pub mod tensor;
#[cfg(test)]
mod tests;

pub use proto::*;
pub use tensor::{data_type_name, tensor_from_proto, tensor_to_proto};

use crate::error::Error;
use crate::files::NewFile;
use crate::{config_err, corrupt_err};
use prost::Message;
use proto::tensor_proto::DataLocation;

use std::io::{self, BufWriter, Read, Seek, SeekFrom, Write};
use std::ops::RangeInclusive;
use std::path::{Component, Path};

/// IR versions this module reads: 3 (the first with `opset_import`) through 11 (onnx 1.18).
pub const IR_VERSIONS: RangeInclusive<i64> = 3..=11;

/// Default-domain opsets a model may import. The engine's ops target 13 to 21; the ONNX node
/// tests it runs span a wider range.
pub const DEFAULT_OPSETS: RangeInclusive<i64> = 7..=23;

/// Protobuf cannot encode or parse a message of 2 GiB or more; larger models need external data.
const MAX_PROTO_BYTES: usize = i32::MAX as usize;

/// Reads an ONNX model, loads the external data of its tensors (files named relative to the
/// model's directory) into `raw_data`, and checks it (see the module's docs).
///
/// A missing or unreadable file is [`Error::Config`]; anything wrong inside it, or in its
/// external data, is [`Error::Corrupt`].
pub fn load_model(path: &Path) -> Result<ModelProto, Error> {
    let origin = path.display().to_string();
    let bytes = crate::files::read_input(path).map_err(|e| io_error(&origin, "cannot read it", e))?;
    let mut model = decode_model(&bytes, &origin)?;
    drop(bytes);
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    resolve_external_data(&mut model, dir, &origin)?;
    Ok(model)
}

/// Decodes and checks a serialized model. `origin` names it in errors (usually its path).
/// Tensors whose data is external are left as they are, since there is no directory to read
/// them from; [`load_model`] resolves them, or call [`resolve_external_data`].
pub fn decode_model(bytes: &[u8], origin: &str) -> Result<ModelProto, Error> {
    if bytes.is_empty() {
        return Err(corrupt_err!("{origin}: the file is empty, not an ONNX model"));
    }
    let mut model = ModelProto::decode(bytes).map_err(|e| corrupt_err!("{origin}: not a valid ONNX model: {e}"))?;
    let dropped = dropped_bytes(bytes.len(), &model);
    if dropped > 0 {
        tracing::warn!(
            "{origin}: {dropped} bytes of fields that ONNX IR version {} does not define were \
             dropped; saving this model again will not keep them",
            IR_VERSIONS.end()
        );
    }
    check_versions(&model, origin)?;
    for_each_tensor(&mut model, &mut |t, _, place| {
        if t.data_location() == DataLocation::External {
            return Ok(());
        }
        tensor::check_payload(t).map_err(|detail| corrupt_err!("{origin}: {place}: {detail}"))
    })?;
    Ok(model)
}

/// Reads every tensor whose `data_location` is EXTERNAL from its file (`location`, relative to
/// `dir`; bytes `offset..offset+length`, or to the end of the file without `length`) into
/// `raw_data`, as `onnx.load_model` does. Locations that lead out of `dir`, absolute ones and
/// those through `..` or a symlink pointing elsewhere, are refused: a model is not allowed to
/// read arbitrary files.
pub fn resolve_external_data(model: &mut ModelProto, dir: &Path, origin: &str) -> Result<(), Error> {
    for_each_tensor(model, &mut |t, _, place| {
        if t.data_location() != DataLocation::External {
            return Ok(());
        }
        let at = format!("{origin}: {place}");
        let (raw, source) = read_external(t, dir, &at)?;
        t.raw_data = Some(raw);
        t.external_data.clear();
        t.data_location = None;
        tensor::check_payload(t).map_err(|detail| corrupt_err!("{at}: {source}: {detail}"))
    })
}

/// Writes a model as one protobuf file (written to a new file, then renamed, so a crash never
/// leaves half a model; only a regular file is replaced, see [`crate::files`]). Fails on models
/// of 2 GiB or more: use
/// [`save_model_with_external_data`] for those.
pub fn save_model(model: &ModelProto, path: &Path) -> Result<(), Error> {
    let origin = path.display().to_string();
    let len = model.encoded_len();
    if len > MAX_PROTO_BYTES {
        return Err(config_err!(
            "{origin}: the model encodes to {len} bytes, over protobuf's 2 GiB limit; save it \
             with external data"
        ));
    }
    crate::files::write_atomically(path, &model.encode_to_vec())
}

/// Writes a model whose initializers of `threshold_bytes` or more (in `raw_data`) live in one
/// side file next to it, `<file name>.data` (e.g. `model.onnx.data`), one after another, each
/// tensor naming it with `location`, `offset` and `length`. This is the layout of
/// `onnx.save_model(..., save_as_external_data=True, all_tensors_to_one_file=True)`, whose
/// default threshold is 1024; like it, initializers of subgraphs are moved too, other tensors
/// (`Constant` values, training_info graphs) stay inline. An existing side file is replaced, not
/// appended to. `model` itself is not changed, and its main graph's weights are not copied in
/// memory.
pub fn save_model_with_external_data(model: &ModelProto, path: &Path, threshold_bytes: usize) -> Result<(), Error> {
    let origin = path.display().to_string();
    let location = path
        .file_name()
        .and_then(|n| n.to_str())
        .map(|n| format!("{n}.data"))
        .ok_or_else(|| config_err!("{origin}: a model file needs a UTF-8 file name"))?;
    let data_path = path.with_file_name(&location);
    let data_origin = data_path.display().to_string();
    let moves = |t: &TensorProto| {
        t.data_location() != DataLocation::External
            && t.raw_data.as_ref().is_some_and(|r| !r.is_empty() && r.len() >= threshold_bytes)
    };
    let mut out = clone_model_without(model, &moves);
    if let Some(data) = write_external_data(model, &mut out, &moves, &location, &data_path, &data_origin)? {
        data.commit()?;
    }
    save_model(&out, path)
}

/// Writes the tensors that `moves` picks to a new file that will replace `data_path`, one after
/// another, pointing their copies in `out` there; returns that file, to commit, if there were
/// any (like onnx, no side file otherwise).
fn write_external_data(
    model: &ModelProto,
    out: &mut ModelProto,
    moves: &dyn Fn(&TensorProto) -> bool,
    location: &str,
    data_path: &Path,
    data_origin: &str,
) -> Result<Option<NewFile>, Error> {
    let mut data: Option<BufWriter<NewFile>> = None;
    let mut offset = 0u64;
    let mut put = |t: &mut TensorProto, raw: &[u8]| -> Result<(), Error> {
        let file = match &mut data {
            Some(f) => f,
            None => data.insert(BufWriter::new(NewFile::create(data_path)?)),
        };
        file.write_all(raw).map_err(|e| io_error(data_origin, "cannot write it", e))?;
        set_external_data(t, location, offset, raw.len());
        offset += raw.len() as u64;
        Ok(())
    };
    if let (Some(src), Some(dst)) = (&model.graph, &mut out.graph) {
        // The main graph's weights are written from `model`: `out` got them without raw_data.
        for (s, d) in src.initializer.iter().zip(&mut dst.initializer) {
            if let Some(raw) = s.raw_data.as_deref().filter(|_| moves(s)) {
                put(d, raw)?;
            }
        }
        // Subgraph initializers (If/Loop/Scan bodies) were copied whole; move them now.
        for_each_tensor_in_graph(dst, "", &mut |t, site, _| {
            if site == Site::Initializer && moves(t) {
                let raw = t.raw_data.take().unwrap_or_default();
                put(t, &raw)?;
            }
            Ok(())
        })?;
    }
    let Some(file) = data else { return Ok(None) };
    let file = file.into_inner().map_err(|e| io_error(data_origin, "cannot write it", e.into_error()))?;
    Ok(Some(file))
}

/// The opset version of the default domain ("" or "ai.onnx"), or 0 when the model imports none
/// (models that [`load_model`] returns always import one, within [`DEFAULT_OPSETS`]).
pub fn default_opset(model: &ModelProto) -> i64 {
    default_imports(model).max().unwrap_or(0)
}

fn default_imports(model: &ModelProto) -> impl Iterator<Item = i64> + '_ {
    model.opset_import.iter().filter(|o| matches!(o.domain(), "" | "ai.onnx")).map(|o| o.version())
}

/// The IR version, the default-domain opset and the presence of a graph: what decides whether
/// the rest of the file can be understood at all.
fn check_versions(model: &ModelProto, origin: &str) -> Result<(), Error> {
    let (lo, hi) = (IR_VERSIONS.start(), IR_VERSIONS.end());
    match model.ir_version {
        None => return Err(corrupt_err!("{origin}: ir_version is not set; is this an ONNX model?")),
        Some(v) if v > *hi => {
            return Err(corrupt_err!(
                "{origin}: ir_version {v} is newer than this worker reads ({lo} to {hi}, as onnx \
                 1.18 writes); export the model with an older onnx package or lower its \
                 ir_version"
            ))
        }
        Some(v) if v < *lo => {
            return Err(corrupt_err!(
                "{origin}: ir_version {v} is older than this worker reads ({lo} to {hi}); update \
                 it with onnx.version_converter"
            ))
        }
        Some(_) => {}
    }
    if model.graph.is_none() {
        return Err(corrupt_err!("{origin}: the model has no graph"));
    }
    let mut versions: Vec<i64> = default_imports(model).collect();
    versions.sort_unstable();
    versions.dedup();
    let (lo, hi) = (DEFAULT_OPSETS.start(), DEFAULT_OPSETS.end());
    match versions[..] {
        [] => Err(corrupt_err!("{origin}: opset_import names no version of the default domain (\"\" or \"ai.onnx\")")),
        [v] if !DEFAULT_OPSETS.contains(&v) => Err(corrupt_err!(
            "{origin}: opset_import: default-domain opset {v} is outside {lo} to {hi}, the opsets \
             this worker reads; convert the model with onnx.version_converter"
        )),
        [_] => Ok(()),
        _ => {
            Err(corrupt_err!("{origin}: opset_import names the default domain more than once, at opsets {versions:?}"))
        }
    }
}

/// How many bytes of the input did not survive decoding. prost skips fields it does not know;
/// re-encoding canonical protobuf (what every ONNX writer emits) gives back the same length
/// otherwise, so a shorter encoding means fields were lost.
fn dropped_bytes(input_len: usize, model: &ModelProto) -> usize {
    input_len.saturating_sub(model.encoded_len())
}

/// Reads one tensor's external data; returns it with a description of where it came from.
fn read_external(t: &TensorProto, dir: &Path, at: &str) -> Result<(Vec<u8>, String), Error> {
    let (mut location, mut offset, mut length) = ("", 0u64, None);
    let number = |key: &str, value: &str| {
        value.parse::<u64>().map_err(|_| corrupt_err!("{at}: external_data {key} {value:?} is not a byte count"))
    };
    // Later keys win and empty numbers count as absent, as in onnx's ExternalDataInfo.
    for entry in &t.external_data {
        match (entry.key(), entry.value()) {
            ("location", v) => location = v,
            ("offset", v) if !v.is_empty() => offset = number("offset", v)?,
            ("length", v) if !v.is_empty() => length = Some(number("length", v)?),
            _ => {}
        }
    }
    if location.is_empty() {
        return Err(corrupt_err!("{at}: data_location is EXTERNAL but external_data has no location"));
    }
    let relative = Path::new(location);
    if !relative.components().all(|c| matches!(c, Component::Normal(_) | Component::CurDir)) {
        return Err(corrupt_err!(
            "{at}: external data location {location:?} must be a path inside the model's \
             directory, without \"..\" or a leading \"/\""
        ));
    }
    let file_path = dir.join(relative);
    let shown = file_path.display();
    let real =
        file_path.canonicalize().map_err(|e| corrupt_err!("{at}: cannot open its external data file {shown}: {e}"))?;
    // A symlink inside the directory may still point out of it.
    let real_dir = dir
        .canonicalize()
        .map_err(|e| corrupt_err!("{at}: cannot open the model's directory {}: {e}", dir.display()))?;
    if !real.starts_with(&real_dir) {
        return Err(corrupt_err!(
            "{at}: external data file {shown} resolves to {}, outside the model's directory",
            real.display()
        ));
    }
    let mut file = crate::files::open_input(&real)
        .map_err(|e| corrupt_err!("{at}: cannot open its external data file {shown}: {e}"))?;
    let metadata =
        file.metadata().map_err(|e| corrupt_err!("{at}: cannot read its external data file {shown}: {e}"))?;
    let size = metadata.len();
    let length = length.unwrap_or(size.saturating_sub(offset));
    let end = offset.checked_add(length).filter(|&end| end <= size).ok_or_else(|| {
        corrupt_err!(
            "{at}: external data file {shown} holds {size} bytes, the tensor's data would \
                 be bytes {offset}..{}",
            offset.saturating_add(length)
        )
    })?;
    // `end` is within a file's size, so the buffer is no bigger than a file that exists.
    let mut raw = vec![0; (end - offset) as usize];
    file.seek(SeekFrom::Start(offset))
        .and_then(|_| file.read_exact(&mut raw))
        .map_err(|e| Error::Runtime(format!("{at}: cannot read its external data file {shown}: {e}")))?;
    Ok((raw, format!("external data {location:?} bytes {offset}..{end}")))
}

fn set_external_data(t: &mut TensorProto, location: &str, offset: u64, length: usize) {
    let entry = |key: &str, value: String| StringStringEntryProto { key: Some(key.to_owned()), value: Some(value) };
    t.raw_data = None;
    t.set_data_location(DataLocation::External);
    t.external_data = vec![
        entry("location", location.to_owned()),
        entry("offset", offset.to_string()),
        entry("length", length.to_string()),
    ];
}

/// A copy of `model` in which the main graph's initializers that `skip` picks have no
/// `raw_data`: the bulk of a large model is never duplicated in memory. The literals below
/// name every field, so a field added to the messages cannot be forgotten here.
fn clone_model_without(model: &ModelProto, skip: &dyn Fn(&TensorProto) -> bool) -> ModelProto {
    let ModelProto {
        ir_version,
        opset_import,
        producer_name,
        producer_version,
        domain,
        model_version,
        doc_string,
        graph,
        metadata_props,
        training_info,
        functions,
        configuration,
    } = model;
    let graph = graph.as_ref().map(|g| {
        let GraphProto {
            node,
            name,
            initializer,
            sparse_initializer,
            doc_string,
            input,
            output,
            value_info,
            quantization_annotation,
            metadata_props,
        } = g;
        GraphProto {
            node: node.clone(),
            name: name.clone(),
            initializer: initializer
                .iter()
                .map(|t| if skip(t) { clone_tensor_without_raw_data(t) } else { t.clone() })
                .collect(),
            sparse_initializer: sparse_initializer.clone(),
            doc_string: doc_string.clone(),
            input: input.clone(),
            output: output.clone(),
            value_info: value_info.clone(),
            quantization_annotation: quantization_annotation.clone(),
            metadata_props: metadata_props.clone(),
        }
    });
    ModelProto {
        ir_version: *ir_version,
        opset_import: opset_import.clone(),
        producer_name: producer_name.clone(),
        producer_version: producer_version.clone(),
        domain: domain.clone(),
        model_version: *model_version,
        doc_string: doc_string.clone(),
        graph,
        metadata_props: metadata_props.clone(),
        training_info: training_info.clone(),
        functions: functions.clone(),
        configuration: configuration.clone(),
    }
}

fn clone_tensor_without_raw_data(t: &TensorProto) -> TensorProto {
    let TensorProto {
        dims,
        data_type,
        segment,
        float_data,
        int32_data,
        string_data,
        int64_data,
        name,
        doc_string,
        raw_data: _,
        external_data,
        data_location,
        double_data,
        uint64_data,
        metadata_props,
    } = t;
    TensorProto {
        dims: dims.clone(),
        data_type: *data_type,
        segment: *segment,
        float_data: float_data.clone(),
        int32_data: int32_data.clone(),
        string_data: string_data.clone(),
        int64_data: int64_data.clone(),
        name: name.clone(),
        doc_string: doc_string.clone(),
        raw_data: None,
        external_data: external_data.clone(),
        data_location: *data_location,
        double_data: double_data.clone(),
        uint64_data: uint64_data.clone(),
        metadata_props: metadata_props.clone(),
    }
}

/// What a tensor is to the graph holding it: external data moves only initializers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Site {
    Initializer,
    /// Attribute values, sparse tensors.
    Other,
}

/// Visits a tensor with its site and a description of where it sits, e.g.
/// `node "If_3" (If) attribute "then_branch": initializer "w"`.
type Visit<'a> = dyn FnMut(&mut TensorProto, Site, &str) -> Result<(), Error> + 'a;

/// Visits every tensor of a model: initializers (also sparse ones) and attribute values, in the
/// main graph and its subgraphs, the training_info graphs and the functions.
fn for_each_tensor(model: &mut ModelProto, f: &mut Visit) -> Result<(), Error> {
    if let Some(g) = &mut model.graph {
        for_each_tensor_in_graph(g, "", f)?;
    }
    for (i, info) in model.training_info.iter_mut().enumerate() {
        if let Some(g) = &mut info.initialization {
            for_each_tensor_in_graph(g, &format!("training_info[{i}].initialization: "), f)?;
        }
        if let Some(g) = &mut info.algorithm {
            for_each_tensor_in_graph(g, &format!("training_info[{i}].algorithm: "), f)?;
        }
    }
    for func in &mut model.functions {
        let scope = format!("function {:?}: ", func.name());
        for a in &mut func.attribute_proto {
            let at = format!("{scope}attribute {:?}", a.name());
            for_each_tensor_in_attribute(a, &at, f)?;
        }
        for node in &mut func.node {
            for_each_tensor_in_node(node, &scope, f)?;
        }
    }
    Ok(())
}

/// `scope` prefixes every description: "" for the main graph, `node "x" (If) attribute "g": `
/// for a subgraph.
fn for_each_tensor_in_graph(g: &mut GraphProto, scope: &str, f: &mut Visit) -> Result<(), Error> {
    for t in &mut g.initializer {
        let at = format!("{scope}initializer {:?}", t.name());
        f(t, Site::Initializer, &at)?;
    }
    for s in &mut g.sparse_initializer {
        let name = s.values.as_ref().map(|v| v.name()).unwrap_or_default();
        let at = format!("{scope}sparse_initializer {name:?}");
        for_each_tensor_in_sparse(s, &at, f)?;
    }
    for node in &mut g.node {
        for_each_tensor_in_node(node, scope, f)?;
    }
    Ok(())
}

fn for_each_tensor_in_node(node: &mut NodeProto, scope: &str, f: &mut Visit) -> Result<(), Error> {
    let at = format!("{scope}node {:?} ({})", node.name(), node.op_type());
    for a in &mut node.attribute {
        let at = format!("{at} attribute {:?}", a.name());
        for_each_tensor_in_attribute(a, &at, f)?;
    }
    Ok(())
}

fn for_each_tensor_in_attribute(a: &mut AttributeProto, at: &str, f: &mut Visit) -> Result<(), Error> {
    if let Some(t) = &mut a.t {
        f(t, Site::Other, at)?;
    }
    for (i, t) in a.tensors.iter_mut().enumerate() {
        f(t, Site::Other, &format!("{at}[{i}]"))?;
    }
    if let Some(s) = &mut a.sparse_tensor {
        for_each_tensor_in_sparse(s, at, f)?;
    }
    for (i, s) in a.sparse_tensors.iter_mut().enumerate() {
        for_each_tensor_in_sparse(s, &format!("{at}[{i}]"), f)?;
    }
    if let Some(g) = &mut a.g {
        for_each_tensor_in_graph(g, &format!("{at}: "), f)?;
    }
    for (i, g) in a.graphs.iter_mut().enumerate() {
        for_each_tensor_in_graph(g, &format!("{at}[{i}]: "), f)?;
    }
    Ok(())
}

fn for_each_tensor_in_sparse(s: &mut SparseTensorProto, at: &str, f: &mut Visit) -> Result<(), Error> {
    if let Some(v) = &mut s.values {
        f(v, Site::Other, &format!("{at} values"))?;
    }
    if let Some(i) = &mut s.indices {
        f(i, Site::Other, &format!("{at} indices"))?;
    }
    Ok(())
}

/// A missing file or directory, one we may not open, or one that is not a regular file, is the
/// user's to fix (exit 2); other I/O failures may pass on a retry (exit 1).
fn io_error(origin: &str, what: &str, e: io::Error) -> Error {
    crate::files::io_failure(&e, format!("{origin}: {what}: {e}"))
}
