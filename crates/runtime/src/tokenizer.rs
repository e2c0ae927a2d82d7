//! The tokenizer: byte-level BPE built from a GGUF file's metadata (vocabulary,
//! merges, token types, pre-tokenizer name) or read from `tokenizer.json`,
//! and the model's chat template.

use crate::config::{md_string, md_u32, md_value};
use crate::error::{Result, RuntimeError};
use candle_core::quantized::gguf_file::{self, Value};
use std::path::Path;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

/// The Qwen2 pre-tokenizer's split pattern (as in Qwen2's tokenizer.json).
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Byte spans `[start, end)` of tokens in a text, one per token.
pub type Spans = Vec<(usize, usize)>;

/// A model's tokenizer with its special tokens and chat template.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    add_bos: bool,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.inner.get_vocab_size(true))
            .field("bos_id", &self.bos_id)
            .field("eos_id", &self.eos_id)
            .finish()
    }
}

fn tok_err(e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Tokenizer(e.to_string())
}

fn string_array(ct: &gguf_file::Content, key: &str) -> Result<Vec<String>> {
    let v = md_value(ct, key)?;
    let arr = v.to_vec().map_err(|e| tok_err(format!("`{key}`: {e}")))?;
    arr.iter()
        .map(|x| {
            x.to_string()
                .cloned()
                .map_err(|e| tok_err(format!("`{key}`: {e}")))
        })
        .collect()
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file describes (`tokenizer.ggml.*`).
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self> {
        let model = md_string(ct, "tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(tok_err(format!(
                "tokenizer model `{model}` is not supported (byte-level BPE `gpt2` only)"
            )));
        }
        let pre = md_string(ct, "tokenizer.ggml.pre").unwrap_or_else(|_| "default".into());
        let tokens = string_array(ct, "tokenizer.ggml.tokens")?;
        let merges_raw = string_array(ct, "tokenizer.ggml.merges")?;
        let types: Vec<i32> = match ct.metadata.get("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.to_i32().map_err(tok_err))
                .collect::<Result<_>>()?,
            _ => vec![1; tokens.len()],
        };
        let vocab: ahash::AHashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let merges = merges_raw
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| tok_err(format!("malformed merge `{m}`")))
            })
            .collect::<Result<Vec<_>>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(false)
            .build()
            .map_err(tok_err)?;
        let mut tk = tokenizers::Tokenizer::new(bpe);
        let byte_level = ByteLevel::new(false, false, false);
        let pre_tok: PreTokenizerWrapper = match pre.as_str() {
            "qwen2" => {
                tk.with_normalizer(Some(NFC));
                Sequence::new(vec![
                    Split::new(
                        SplitPattern::Regex(QWEN2_PATTERN.into()),
                        SplitDelimiterBehavior::Isolated,
                        false,
                    )
                    .map_err(tok_err)?
                    .into(),
                    byte_level.into(),
                ])
                .into()
            }
            // SmolLM splits digits one by one, then applies the GPT-2 pattern.
            "smollm" => Sequence::new(vec![
                Digits::new(true).into(),
                ByteLevel::new(false, true, true).into(),
            ])
            .into(),
            "default" | "gpt2" => ByteLevel::new(false, true, true).into(),
            other => {
                return Err(tok_err(format!(
                    "pre-tokenizer `{other}` is not supported (qwen2, smollm, gpt2)"
                )))
            }
        };
        tk.with_pre_tokenizer(Some(pre_tok));
        tk.with_decoder(Some(ByteLevel::default()));
        let mut specials = Vec::new();
        let mut added = Vec::new();
        for (i, t) in tokens.iter().enumerate() {
            match types.get(i) {
                Some(3) => specials.push(AddedToken::from(t.clone(), true)),
                Some(4) => added.push(AddedToken::from(t.clone(), false).normalized(false)),
                _ => {}
            }
        }
        tk.add_special_tokens(&specials);
        tk.add_tokens(&added);
        let bos_id = md_u32(ct, "tokenizer.ggml.bos_token_id").ok();
        let eos_id = md_u32(ct, "tokenizer.ggml.eos_token_id").ok();
        let add_bos = ct
            .metadata
            .get("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(false);
        let chat_template = md_string(ct, "tokenizer.chat_template").ok();
        Ok(Self {
            inner: tk,
            bos_id,
            eos_id,
            add_bos,
            chat_template,
        })
    }

    /// Reads `tokenizer.json` (and, beside it, `tokenizer_config.json` for the
    /// chat template and special tokens, if present).
    pub fn from_json_file(path: &Path) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| tok_err(format!("{}: {e}", path.display())))?;
        let mut out = Self {
            inner,
            bos_id: None,
            eos_id: None,
            add_bos: false,
            chat_template: None,
        };
        let cfg_path = path.with_file_name("tokenizer_config.json");
        if let Ok(text) = std::fs::read_to_string(&cfg_path) {
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| tok_err(format!("{}: {e}", cfg_path.display())))?;
            out.chat_template = v
                .get("chat_template")
                .and_then(|t| t.as_str())
                .map(String::from);
            let id = |k: &str| {
                v.get(k)
                    .and_then(|t| {
                        t.as_str()
                            .or_else(|| t.get("content").and_then(|c| c.as_str()))
                    })
                    .and_then(|s| out.inner.token_to_id(s))
            };
            out.bos_id = id("bos_token");
            out.eos_id = id("eos_token");
            out.add_bos = v
                .get("add_bos_token")
                .and_then(|b| b.as_bool())
                .unwrap_or(false);
        }
        Ok(out)
    }

    /// Token ids of `text`, without special-token post-processing (a BOS is
    /// prepended only where the model's metadata asks for one). Special-token
    /// strings in the text (`<|im_start|>`) become their ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(tok_err)?;
        let mut ids = enc.get_ids().to_vec();
        if self.add_bos {
            if let Some(b) = self.bos_id {
                ids.insert(0, b);
            }
        }
        Ok(ids)
    }

    /// Token ids of a text fragment, never with a BOS (for segment-by-segment tokenization).
    pub fn encode_fragment(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(tok_err)?
            .get_ids()
            .to_vec())
    }

    /// Token ids of `text` (as [`Tokenizer::encode`]) with each token's byte
    /// span `[start, end)` in `text`: character offsets, in bytes, from the
    /// tokenizer's own alignment (through its normalizer). A prepended BOS
    /// spans `(0, 0)`. Byte-level tokens that split one character share its span.
    pub fn encode_with_offsets(&self, text: &str) -> Result<(Vec<u32>, Spans)> {
        let enc = self.inner.encode(text, false).map_err(tok_err)?;
        let mut ids = enc.get_ids().to_vec();
        let mut spans: Vec<(usize, usize)> = enc.get_offsets().to_vec();
        if self.add_bos {
            if let Some(b) = self.bos_id {
                ids.insert(0, b);
                spans.insert(0, (0, 0));
            }
        }
        Ok((ids, spans))
    }

    /// The text token ids spell and each id's byte span `[start, end)` in it,
    /// for ids this tokenizer produced (segment by segment or at once): the
    /// bytes of a byte-level token, the content of an added or special token
    /// (`<|im_start|>`). A BOS at the start, where the model prepends one,
    /// spans `(0, 0)` and adds no text. Fails on an id that is not a
    /// byte-level token or an added token, or when the bytes are not UTF-8.
    pub fn token_spans(&self, ids: &[u32]) -> Result<(String, Spans)> {
        let added = self.inner.get_added_tokens_decoder();
        let unbyte = unbyte_map();
        let mut bytes: Vec<u8> = Vec::new();
        let mut spans = Vec::with_capacity(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            let start = bytes.len();
            if i == 0 && self.add_bos && Some(id) == self.bos_id {
                spans.push((0, 0));
                continue;
            }
            if let Some(t) = added.get(&id) {
                bytes.extend_from_slice(t.content.as_bytes());
            } else {
                let tok = self
                    .inner
                    .id_to_token(id)
                    .ok_or_else(|| tok_err(format!("token id {id} is not in the vocabulary")))?;
                for c in tok.chars() {
                    let b = unbyte.get(&c).ok_or_else(|| {
                        tok_err(format!(
                            "token {id} (`{tok}`) is not a byte-level token: character offsets need byte-level BPE"
                        ))
                    })?;
                    bytes.push(*b);
                }
            }
            spans.push((start, bytes.len()));
        }
        let text = String::from_utf8(bytes)
            .map_err(|e| tok_err(format!("the tokens do not spell UTF-8 text: {e}")))?;
        Ok((text, spans))
    }

    /// The text of token ids (special tokens included).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(tok_err)
    }

    /// The id of a token string, if it is in the vocabulary.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id.
    pub fn token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Vocabulary size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The end-of-sequence id.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// Ids that end a chat turn or a document (eos, `<|im_end|>`, `<|endoftext|>`).
    pub fn stop_ids(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.eos_id.into_iter().collect();
        for t in ["<|im_end|>", "<|endoftext|>"] {
            if let Some(id) = self.token_id(t) {
                if !v.contains(&id) {
                    v.push(id);
                }
            }
        }
        v
    }

    /// The chat template text, if the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Wraps a user message in the model's chat template, ending where the
    /// assistant's answer starts.
    pub fn apply_chat_template(&self, user: &str) -> Result<String> {
        let tpl = self
            .chat_template
            .as_deref()
            .ok_or_else(|| tok_err("the model has no chat template"))?;
        let mut env = minijinja::Environment::new();
        env.add_template("chat", tpl).map_err(tok_err)?;
        let t = env.get_template("chat").map_err(tok_err)?;
        t.render(minijinja::context! {
            messages => vec![minijinja::context!{ role => "user", content => user }],
            add_generation_prompt => true,
            bos_token => self.bos_id.and_then(|b| self.token(b)).unwrap_or_default(),
            eos_token => self.eos_id.and_then(|b| self.token(b)).unwrap_or_default(),
        })
        .map_err(tok_err)
    }
}

/// GPT-2's byte-level alphabet, inverted: the byte each character of a
/// byte-level token stands for.
fn unbyte_map() -> std::collections::HashMap<char, u8> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    bs.into_iter()
        .zip(cs)
        .filter_map(|(b, c)| char::from_u32(c).map(|c| (c, b as u8)))
        .collect()
}

impl Tokenizer {
    /// Writes the tokenizer as a Hugging Face `tokenizer.json`.
    pub fn save_json(&self, path: &Path) -> Result<()> {
        self.inner.save(path, false).map_err(tok_err)
    }
}

impl Tokenizer {
    /// Reads only the tokenizer of a GGUF file (no weights).
    pub fn from_gguf_file(path: &Path) -> Result<Self> {
        let mut f = std::fs::File::open(path).map_err(|e| crate::RuntimeError::ModelFile {
            path: path.into(),
            reason: format!("cannot open: {e}"),
        })?;
        let ct = gguf_file::Content::read(&mut f).map_err(|e| crate::RuntimeError::ModelFile {
            path: path.into(),
            reason: format!("not a readable GGUF file: {e}"),
        })?;
        Self::from_gguf(&ct)
    }
}
