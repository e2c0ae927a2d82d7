//! The machine a run computes on: its CPU, the SIMD instructions candle's
//! kernels can use there, and the threads. Recorded beside every run and
//! bench figure, since the same build runs at very different speeds on
//! different machines (the shared speed notes' AVX-512 part and an AVX2-only
//! AMD EPYC, two cores each, differ two- to sixfold in f32 matmul GFLOP/s).

/// What a run's numbers were computed on.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Machine {
    /// The CPU's model name as the operating system reports it
    /// (`/proc/cpuinfo` on Linux), or `unknown`.
    pub cpu: String,
    /// The SIMD extensions this CPU offers that matmul kernels use
    /// (x86-64: avx, avx2, fma, avx512f; aarch64: neon).
    pub simd: Vec<String>,
    /// Logical CPUs available to this process.
    pub logical_cpus: usize,
    /// Threads candle's CPU kernels use.
    pub threads: usize,
}

/// The machine this process runs on.
pub fn machine() -> Machine {
    Machine {
        cpu: cpu_model().unwrap_or_else(|| "unknown".into()),
        simd: simd_features(),
        logical_cpus: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        threads: candle_core::utils::get_num_threads(),
    }
}

fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    info.lines()
        .find(|l| l.starts_with("model name") || l.starts_with("Model"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

#[cfg(target_arch = "x86_64")]
fn simd_features() -> Vec<String> {
    let mut f = Vec::new();
    if std::arch::is_x86_feature_detected!("avx") {
        f.push("avx");
    }
    if std::arch::is_x86_feature_detected!("avx2") {
        f.push("avx2");
    }
    if std::arch::is_x86_feature_detected!("fma") {
        f.push("fma");
    }
    if std::arch::is_x86_feature_detected!("avx512f") {
        f.push("avx512f");
    }
    f.into_iter().map(String::from).collect()
}

#[cfg(target_arch = "aarch64")]
fn simd_features() -> Vec<String> {
    if std::arch::is_aarch64_feature_detected!("neon") {
        vec!["neon".into()]
    } else {
        Vec::new()
    }
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn simd_features() -> Vec<String> {
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn describes_this_machine() {
        let m = machine();
        assert!(!m.cpu.is_empty());
        assert!(m.logical_cpus >= 1);
        assert!(m.threads >= 1);
        // Serialized under the field names run.json readers use.
        let v = serde_json::to_value(&m).unwrap();
        for k in ["cpu", "simd", "logical_cpus", "threads"] {
            assert!(v.get(k).is_some(), "{k} missing from {v}");
        }
    }
}
