//! How tensors are named in a checkpoint's rank files: weights by their graph names, optimizer
//! state under `optimizer/<weight>/<k>`, a ZeRO piece as `<key>@<first element>`, a
//! tensor-parallel slice as `<key>#tp<rank>` (before a piece's `@`).

/// Checkpointed optimizer tensors are named under this prefix; weights keep their own names.
pub const OPTIMIZER_PREFIX: &str = "optimizer/";
/// The step count and the loss scaler's state: every rank holds the same ones (`SHARED_KEYS`).
pub const STEP_KEY: &str = "optimizer/step";
pub const LOSS_SCALE_KEY: &str = "optimizer/loss_scale";
pub const SHARED_KEYS: [&str; 2] = [STEP_KEY, LOSS_SCALE_KEY];
/// Marks a tensor-parallel rank's slice in a tensor's name: `<name>#tp<rank>`.
pub const SLICE_MARK: &str = "#tp";

/// The key of state tensor `k` (Adam's first moment is 0, say) of `weight`.
pub fn optimizer_key(weight: &str, k: usize) -> String {
    format!("{OPTIMIZER_PREFIX}{weight}/{k}")
}

/// The key of a ZeRO piece of `key`: the 1-D run of its flattened elements from `start`.
pub fn piece_key(key: &str, start: usize) -> String {
    format!("{key}@{start}")
}

/// `key` marked as tensor-parallel rank `rank`'s slice (before a piece's `@<start>`), when the
/// weight it belongs to `is_split`; other keys as they are.
pub fn slice_key(key: &str, rank: usize, is_split: impl Fn(&str) -> bool) -> String {
    let (base, piece) = match key.rsplit_once('@') {
        Some((base, start)) if start.parse::<usize>().is_ok() => (base, &key[base.len()..]),
        _ => (key, ""),
    };
    if weight_of_key(base).is_some_and(is_split) {
        format!("{base}{SLICE_MARK}{rank}{piece}")
    } else {
        key.to_string()
    }
}

/// The weight a state key belongs to: the key itself, or `<w>` of `optimizer/<w>/<k>`; None
/// for `optimizer/step`.
pub fn weight_of_key(key: &str) -> Option<&str> {
    match key.strip_prefix(OPTIMIZER_PREFIX) {
        None => Some(key),
        Some(rest) => rest.rsplit_once('/').filter(|(_, k)| k.parse::<usize>().is_ok()).map(|(w, _)| w),
    }
}
