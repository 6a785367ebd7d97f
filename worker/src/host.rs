//! What this machine (or the container it runs in) offers the worker.

/// The memory the process may use: the machine's, or the container's limit where one is lower
/// (cgroup v2, then v1). None where /proc/meminfo cannot be read. Read once.
pub fn memory_bytes() -> Option<usize> {
    static TOTAL: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *TOTAL.get_or_init(|| {
        let info = std::fs::read_to_string("/proc/meminfo").ok()?;
        let kib: usize = info.lines().find(|l| l.starts_with("MemTotal:"))?.split_whitespace().nth(1)?.parse().ok()?;
        let limit = ["/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"]
            .iter()
            .find_map(|p| std::fs::read_to_string(p).ok()?.trim().parse::<usize>().ok());
        let machine = kib.checked_mul(1024)?;
        Some(limit.map_or(machine, |l| l.min(machine)))
    })
}
