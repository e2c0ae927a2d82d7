//! tolerable's model runtime: checkpoints (GGUF, safetensors), the tokenizer,
//! a manual-attention forward pass with TransformerLens-named hook points, the
//! explicit KV cache, greedy decoding, and the verification gates.
//!
//! It loads models from a path; where model files come from (the catalog,
//! the Hugging Face hub) and whether they are genuine is `tolerable-fetch`'s
//! job, and the tiny random models of the tests are `tolerable-testkit`'s.
#![warn(missing_docs)]

pub mod checkpoint;
pub mod config;
pub mod error;
mod fused;
pub mod gates;
pub mod hooks;
pub mod kv_cache;
pub mod machine;
mod matvec;
pub mod model;
pub mod reference;
pub mod weights;

pub use config::{Arch, ModelConfig, RopeStyle};
pub use error::{Result, RuntimeError};
pub use hooks::{Adapter, Edit, HookCache, HookPoint, HookSpec, Intervention, Projection};
pub use kv_cache::{KvCache, LayerKv, RowLayout, Segment, SegmentKind};
pub use machine::{machine, Machine};
pub use model::{ForwardOutput, Generation, GreedyOptions, Kernels, LogitsAt, Model};
pub use weights::{
    avx512_kernels, matmul_backend, Precision, Proj, AVX512_KERNELS, MATMUL_BACKEND,
};
pub mod tokenizer;
pub use checkpoint::Checkpoint;
pub use tokenizer::{Spans, Tokenizer};
