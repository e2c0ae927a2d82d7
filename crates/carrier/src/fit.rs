//! Fitted substitutes (PROTOCOL §5, the "sender-side construction" family):
//! maps fitted to reproduce the receiver's genuine keys from a sender-side
//! input (a held-out sender's keys, or the receiver's keys under noise).
//!
//! Three families, all pure functions of their training rows and seed:
//!
//! - [`least_squares`]: an affine map `y ≈ x W + b`, ridge-regularised,
//!   solved in f64.
//! - [`least_squares_in_subspace`] with [`key_subspace`]: the same, restricted
//!   to the row and column space of a head's key projection `W_k` (see
//!   [`key_subspace`] for what that means concretely). It acts on pre-RoPE
//!   keys; [`rope_rotate`] moves keys between the two frames.
//! - [`train_mlp`]: one hidden layer on a residual path, `y ≈ x + MLP(x)`,
//!   trained with candle's autograd and AdamW under an [`Objective`]
//!   (MSE, cosine, hinge on cosine).
//!
//! Rows are vectors: inputs `[n, d_in]`, outputs `[n, d_out]`, f32 tensors.

use crate::error::{CarrierError, Result};
use crate::rng::Gaussian;
use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use nalgebra::{DMatrix, SVD};
use serde::{Deserialize, Serialize};
use tolerable_runtime::RopeStyle;

fn bad<T>(m: impl Into<String>) -> Result<T> {
    Err(CarrierError::BadFit(m.into()))
}

/// An affine map of row vectors, `y = x W + b`.
#[derive(Debug, Clone)]
pub struct AffineMap {
    /// `W`, `[d_in, d_out]`.
    pub weight: Tensor,
    /// `b`, `[d_out]`.
    pub bias: Tensor,
}

impl AffineMap {
    /// The map applied to rows `x` `[n, d_in]`: `[n, d_out]`.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.to_dtype(DType::F32)?;
        Ok(x.matmul(&self.weight)?.broadcast_add(&self.bias)?)
    }

    /// Input width.
    pub fn d_in(&self) -> usize {
        self.weight.dims()[0]
    }

    /// Output width.
    pub fn d_out(&self) -> usize {
        self.weight.dims()[1]
    }
}

fn to_matrix(t: &Tensor) -> Result<DMatrix<f64>> {
    let (n, d) = t.dims2()?;
    let v: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    Ok(DMatrix::from_row_iterator(
        n,
        d,
        v.into_iter().map(|x| x as f64),
    ))
}

fn to_tensor(m: &DMatrix<f64>, device: &Device) -> Result<Tensor> {
    let (r, c) = m.shape();
    let mut v = Vec::with_capacity(r * c);
    for i in 0..r {
        for j in 0..c {
            v.push(m[(i, j)] as f32);
        }
    }
    Ok(Tensor::from_vec(v, (r, c), device)?)
}

fn check_rows(x: &Tensor, y: &Tensor) -> Result<(usize, usize, usize)> {
    let (n, dx) = x.dims2()?;
    let (ny, dy) = y.dims2()?;
    if n != ny {
        return bad(format!("{n} input rows but {ny} target rows"));
    }
    if n == 0 {
        return bad("no training rows");
    }
    Ok((n, dx, dy))
}

/// Solves `(A + lambda I) X = B` for symmetric positive semi-definite `A`
/// (Cholesky, else an SVD least-squares solve when `A + lambda I` is singular).
fn solve_normal(a: DMatrix<f64>, b: &DMatrix<f64>, lambda: f64) -> Result<DMatrix<f64>> {
    let d = a.nrows();
    let reg = a + DMatrix::<f64>::identity(d, d) * lambda;
    if let Some(ch) = reg.clone().cholesky() {
        return Ok(ch.solve(b));
    }
    SVD::new(reg, true, true)
        .solve(b, 1e-12)
        .map_err(|e| CarrierError::BadFit(format!("normal equations: {e}")))
}

/// Column means of `m` (a row vector) and `m` with them subtracted.
fn center(m: &DMatrix<f64>) -> (DMatrix<f64>, DMatrix<f64>) {
    let n = m.nrows() as f64;
    let mean = m.row_sum() / n;
    let mut c = m.clone();
    for mut row in c.row_iter_mut() {
        row -= &mean;
    }
    (DMatrix::from_row_slice(1, m.ncols(), mean.as_slice()), c)
}

/// The ridge penalty of a design `xc` (centered): `ridge` times the mean
/// diagonal of `xcᵀ xc`, so `ridge` is relative to the input's scale.
fn penalty(gram: &DMatrix<f64>, ridge: f64) -> f64 {
    let d = gram.nrows().max(1) as f64;
    ridge * gram.trace() / d
}

/// The affine least-squares map from rows `x` `[n, d_in]` to rows `y`
/// `[n, d_out]`: `W = (XcᵀXc + λI)⁻¹ XcᵀYc` on centered rows, `b = ȳ − x̄ W`,
/// with `λ = ridge · tr(XcᵀXc) / d_in` (the bias is not penalised). Solved
/// in f64. `ridge = 0` is ordinary least squares.
pub fn least_squares(x: &Tensor, y: &Tensor, ridge: f64) -> Result<AffineMap> {
    check_rows(x, y)?;
    if !(ridge >= 0.0 && ridge.is_finite()) {
        return bad(format!("ridge {ridge} is not a finite non-negative number"));
    }
    let (xm, ym) = (to_matrix(x)?, to_matrix(y)?);
    let (xbar, xc) = center(&xm);
    let (ybar, yc) = center(&ym);
    let gram = xc.transpose() * &xc;
    let lambda = penalty(&gram, ridge);
    let w = solve_normal(gram, &(xc.transpose() * &yc), lambda)?;
    let b = ybar - xbar * &w;
    let device = x.device();
    Ok(AffineMap {
        weight: to_tensor(&w, device)?,
        bias: to_tensor(&b, device)?.squeeze(0)?,
    })
}

/// The least-squares normal equations of an affine map, accumulated batch
/// by batch (rows of many passages need not be held at once): shifted sums
/// `Σ(x−c)`, `Σ(y−d)`, `Σ(x−c)(x−c)ᵀ` and `Σ(x−c)(y−d)ᵀ` in f64, with the
/// shifts `c`, `d` the first batch's column means (so the large common
/// offsets of residual streams do not cost precision). Products of one
/// batch are formed in f32 and summed in f64. [`NormalEquations::solve`]
/// gives the map [`least_squares`] would fit on the rows at once (ridge
/// relative to the input's scale, bias unpenalised), optionally truncated
/// to a rank.
#[derive(Debug, Clone)]
pub struct NormalEquations {
    n: usize,
    shift_x: Vec<f32>,
    shift_y: Vec<f32>,
    sx: DMatrix<f64>,
    sy: DMatrix<f64>,
    xtx: DMatrix<f64>,
    xty: DMatrix<f64>,
    yty: f64,
}

fn shifted(t: &Tensor, shift: &[f32]) -> Result<Tensor> {
    let s = Tensor::from_vec(shift.to_vec(), shift.len(), t.device())?;
    Ok(t.to_dtype(DType::F32)?.broadcast_sub(&s)?.contiguous()?)
}

fn add_to(acc: &mut DMatrix<f64>, t: &Tensor) -> Result<()> {
    let (r, c) = t.dims2()?;
    let v: Vec<f32> = t.flatten_all()?.to_vec1()?;
    for i in 0..r {
        for j in 0..c {
            acc[(i, j)] += v[i * c + j] as f64;
        }
    }
    Ok(())
}

impl NormalEquations {
    /// Empty equations of a map from `d_in` to `d_out` coordinates.
    pub fn new(d_in: usize, d_out: usize) -> Self {
        Self {
            n: 0,
            shift_x: Vec::new(),
            shift_y: Vec::new(),
            sx: DMatrix::zeros(1, d_in),
            sy: DMatrix::zeros(1, d_out),
            xtx: DMatrix::zeros(d_in, d_in),
            xty: DMatrix::zeros(d_in, d_out),
            yty: 0.0,
        }
    }

    /// Rows accumulated so far.
    pub fn rows(&self) -> usize {
        self.n
    }

    /// Input width.
    pub fn d_in(&self) -> usize {
        self.xtx.nrows()
    }

    /// Output width.
    pub fn d_out(&self) -> usize {
        self.xty.ncols()
    }

    /// Adds rows `x` `[n, d_in]` and their targets `y` `[n, d_out]`.
    pub fn add(&mut self, x: &Tensor, y: &Tensor) -> Result<()> {
        let (n, dx, dy) = check_rows(x, y)?;
        if dx != self.d_in() || dy != self.d_out() {
            return bad(format!(
                "rows of {dx} -> {dy} coordinates added to equations of {} -> {}",
                self.d_in(),
                self.d_out()
            ));
        }
        if self.n == 0 {
            let mean = |t: &Tensor| -> Result<Vec<f32>> {
                Ok(t.to_dtype(DType::F32)?.mean(0)?.to_vec1()?)
            };
            self.shift_x = mean(x)?;
            self.shift_y = mean(y)?;
        }
        let xs = shifted(x, &self.shift_x)?;
        let ys = shifted(y, &self.shift_y)?;
        add_to(&mut self.sx, &xs.sum_keepdim(0)?)?;
        add_to(&mut self.sy, &ys.sum_keepdim(0)?)?;
        let xt = xs.t()?.contiguous()?;
        add_to(&mut self.xtx, &xt.matmul(&xs)?)?;
        add_to(&mut self.xty, &xt.matmul(&ys)?)?;
        self.yty += ys.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
        self.n += n;
        Ok(())
    }

    /// The share of the targets' variance about their mean that `map`
    /// explains on the rows added (R², `1 − SSE/SST`; 1 is exact, 0 no
    /// better than the mean, negative worse).
    pub fn explained(&self, map: &AffineMap) -> Result<f64> {
        if self.n == 0 {
            return bad("no training rows");
        }
        let n = self.n as f64;
        let xm = &self.sx / n;
        let ym = &self.sy / n;
        let gram = &self.xtx - xm.transpose() * &xm * n;
        let cross = &self.xty - xm.transpose() * &ym * n;
        let sst = self.yty - (ym.norm_squared() * n);
        let w = to_matrix(&map.weight)?;
        // The map's residuals about the means: (y − ȳ) − (x − x̄) W, plus the
        // offset of its bias from the least-squares one (b − (ȳ − x̄ W)).
        let to_row =
            |v: &[f32]| DMatrix::from_row_iterator(1, v.len(), v.iter().map(|&x| x as f64));
        let xbar = &xm + to_row(&self.shift_x);
        let ybar = &ym + to_row(&self.shift_y);
        let b = to_matrix(&map.bias.unsqueeze(0)?)?;
        let off = b - (ybar - xbar * &w);
        let sse = sst - 2.0 * (w.transpose() * &cross).trace()
            + (w.transpose() * &gram * &w).trace()
            + off.norm_squared() * n;
        Ok(if sst > 0.0 { 1.0 - sse / sst } else { 0.0 })
    }

    /// The affine map `y ≈ x W + b` on every row added: `W = (G + λI)⁻¹ C`
    /// with `G`, `C` the centered Gram and cross products, `λ = ridge ·
    /// tr(G) / d_in`, `b = ȳ − x̄ W`. With `rank`, `W` is replaced by its
    /// truncated SVD (the `rank` largest singular values kept; a rank at or
    /// above `min(d_in, d_out)` keeps all).
    pub fn solve(&self, ridge: f64, rank: Option<usize>) -> Result<AffineMap> {
        if self.n == 0 {
            return bad("no training rows");
        }
        if !(ridge >= 0.0 && ridge.is_finite()) {
            return bad(format!("ridge {ridge} is not a finite non-negative number"));
        }
        let n = self.n as f64;
        let xm = &self.sx / n; // shifted means
        let ym = &self.sy / n;
        let gram = &self.xtx - xm.transpose() * &xm * n;
        let cross = &self.xty - xm.transpose() * &ym * n;
        let lambda = penalty(&gram, ridge);
        let mut w = solve_normal(gram, &cross, lambda)?;
        if let Some(r) = rank.filter(|&r| r < w.nrows().min(w.ncols())) {
            let svd = SVD::new(w.clone(), true, true);
            let (u, vt) = match (svd.u, svd.v_t) {
                (Some(u), Some(vt)) => (u, vt),
                _ => return bad("the SVD of the map did not converge"),
            };
            // nalgebra sorts singular values in descending order.
            let mut sr = DMatrix::<f64>::zeros(r, r);
            for i in 0..r {
                sr[(i, i)] = svd.singular_values[i];
            }
            w = u.columns(0, r) * sr * vt.rows(0, r);
        }
        let to_row =
            |v: &[f32]| DMatrix::from_row_iterator(1, v.len(), v.iter().map(|&x| x as f64));
        let xbar = xm + to_row(&self.shift_x);
        let ybar = ym + to_row(&self.shift_y);
        let b = ybar - xbar * &w;
        Ok(AffineMap {
            weight: to_tensor(&w, &Device::Cpu)?,
            bias: to_tensor(&b, &Device::Cpu)?.squeeze(0)?,
        })
    }
}

/// The subspace a head's key projection writes to, for
/// [`least_squares_in_subspace`]: `U_r`, `[head_dim, r]` with orthonormal
/// columns, the left singular vectors of the head's `W_k` (`[head_dim,
/// d_model]`, rows of the layer's key projection) for its `rank` largest
/// singular values (`None`: the numerical rank).
///
/// **What "restricted to the row and column space of `W_k`" means here.**
/// The receiver's pre-RoPE key is `u = W_k h + b_k` for a normed residual
/// `h`. A map in the residual → key form predicts it from a sender-side
/// pre-RoPE key `u_s` as `û = b_k + W_k P W_k⁺ (u_s − b_k)`: pull the
/// sender's key back to the residual component it determines, move it with
/// a map `P` restricted to `W_k`'s rank-`r` row space (`P = V_r C V_rᵀ`),
/// and write it through `W_k`. Since `W_k V_r = U_r Σ_r` this is
/// `û = b_k + U_r D U_rᵀ (u_s − b_k)` with `D = Σ_r C Σ_r⁻¹`: output in the
/// affine column space `b_k + span(U_r)`, input read only through its
/// projection on `span(U_r)`, bias fixed to the layer's own. We fit `D`.
/// At full rank (`r = head_dim`, the usual case: `W_k` has more columns
/// than rows) the restriction keeps only the fixed bias and the pre-RoPE
/// frame (one map serves every position exactly); below it, the keys are
/// confined to `W_k`'s `r` dominant output directions.
pub fn key_subspace(w_k: &Tensor, rank: Option<usize>) -> Result<Tensor> {
    let (hd, _) = w_k.dims2()?;
    let m = to_matrix(w_k)?;
    let svd = SVD::new(m, true, false);
    let u = svd
        .u
        .ok_or_else(|| CarrierError::BadFit("SVD of W_k gave no U".into()))?;
    let s = &svd.singular_values;
    let mut order: Vec<usize> = (0..s.len()).collect();
    order.sort_by(|&a, &b| s[b].total_cmp(&s[a]));
    let top = s.iter().cloned().fold(0.0f64, f64::max);
    let numerical = s.iter().filter(|&&v| v > top * 1e-10).count();
    let r = match rank {
        Some(r) if r == 0 || r > numerical => {
            return bad(format!(
                "rank {r} of a key projection of numerical rank {numerical} (head_dim {hd}): need 1 <= rank <= {numerical}"
            ))
        }
        Some(r) => r,
        None => numerical,
    };
    let cols: Vec<_> = order[..r]
        .iter()
        .map(|&i| u.column(i).into_owned())
        .collect();
    let basis = DMatrix::from_columns(&cols);
    to_tensor(&basis, w_k.device())
}

/// The least-squares map `û = b + (u_s − b) U D Uᵀ` (row-vector form of
/// `b + U D Uᵀ (u_s − b)`) from rows `x` to rows `y` (`[n, d]` each), for
/// an orthonormal `basis` `U` `[d, r]` and a fixed `offset` `b` `[d]`:
/// `D` (`r × r`) is the ridge least-squares fit, without intercept, of the
/// targets' coordinates `(y − b) U` on the inputs' `(x − b) U`, with
/// `λ = ridge · tr(ZᵀZ) / r`. Every output lies in `b + span(U)`. See
/// [`key_subspace`] for the restriction to a key projection's spaces.
pub fn least_squares_in_subspace(
    x: &Tensor,
    y: &Tensor,
    basis: &Tensor,
    offset: &Tensor,
    ridge: f64,
) -> Result<AffineMap> {
    let (_, dx, dy) = check_rows(x, y)?;
    let (d, _r) = basis.dims2()?;
    if dx != d || dy != d || offset.dims() != [d] {
        return bad(format!(
            "a subspace map needs inputs, targets and offset of width {d} (got {dx}, {dy}, {:?})",
            offset.dims()
        ));
    }
    if !(ridge >= 0.0 && ridge.is_finite()) {
        return bad(format!("ridge {ridge} is not a finite non-negative number"));
    }
    let u = to_matrix(basis)?;
    let b = to_matrix(&offset.unsqueeze(0)?)?;
    let shift = |m: DMatrix<f64>| {
        let mut m = m;
        for mut row in m.row_iter_mut() {
            row -= &b;
        }
        m
    };
    let zs = shift(to_matrix(x)?) * &u;
    let zr = shift(to_matrix(y)?) * &u;
    let gram = zs.transpose() * &zs;
    let lambda = penalty(&gram, ridge);
    let dmat = solve_normal(gram, &(zs.transpose() * &zr), lambda)?;
    let w = &u * dmat * u.transpose();
    let bias = &b - &b * &w;
    let device = x.device();
    Ok(AffineMap {
        weight: to_tensor(&w, device)?,
        bias: to_tensor(&bias, device)?.squeeze(0)?,
    })
}

/// Rows `x` `[n, head_dim]` rotated by RoPE at `positions` (one a row), as
/// the runtime rotates keys (`theta` the base frequency, `style` the
/// pairing), or un-rotated (`inverse`): post-RoPE keys to the pre-RoPE
/// frame where `W_k` writes. Computed in f64.
pub fn rope_rotate(
    x: &Tensor,
    positions: &[usize],
    theta: f64,
    style: RopeStyle,
    inverse: bool,
) -> Result<Tensor> {
    let (n, hd) = x.dims2()?;
    if positions.len() != n {
        return bad(format!("{n} rows but {} positions", positions.len()));
    }
    if !hd.is_multiple_of(2) {
        return bad(format!("head_dim {hd} is odd"));
    }
    let half = hd / 2;
    // As the runtime's tables: frequency i is theta^(-2i/hd), computed in f32.
    let inv: Vec<f32> = (0..hd)
        .step_by(2)
        .map(|i| 1f32 / (theta as f32).powf(i as f32 / hd as f32))
        .collect();
    let v: Vec<f32> = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let mut out = v.clone();
    let sign = if inverse { -1.0 } else { 1.0 };
    for (r, &p) in positions.iter().enumerate() {
        let row = &v[r * hd..(r + 1) * hd];
        let o = &mut out[r * hd..(r + 1) * hd];
        for (i, &f) in inv.iter().enumerate() {
            let ang = (p as f32 * f) as f64;
            let (c, s) = (ang.cos(), sign * ang.sin());
            let (a, b) = match style {
                RopeStyle::Half => (i, i + half),
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
            };
            let (xa, xb) = (row[a] as f64, row[b] as f64);
            o[a] = (xa * c - xb * s) as f32;
            o[b] = (xb * c + xa * s) as f32;
        }
    }
    Ok(Tensor::from_vec(out, (n, hd), x.device())?)
}

/// What an MLP substitute is trained to minimise, per row split into
/// vectors of `group` coordinates (one a kv head).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Objective {
    /// Mean squared error (in the inputs' rescaled units).
    Mse,
    /// Mean of `1 − cos(ŷ, y)` over vectors.
    Cosine,
    /// Mean of `max(0, margin − cos(ŷ, y))` over vectors: only vectors below
    /// the margin cost anything (a worst-case-leaning cosine objective).
    Hinge,
}

impl Objective {
    /// Name in configs and records.
    pub fn name(self) -> &'static str {
        match self {
            Objective::Mse => "mse",
            Objective::Cosine => "cosine",
            Objective::Hinge => "hinge",
        }
    }
}

/// How an MLP substitute is trained.
#[derive(Debug, Clone, PartialEq)]
pub struct MlpTraining {
    /// Hidden width.
    pub hidden: usize,
    /// The objective.
    pub objective: Objective,
    /// Margin of the hinge objective (a cosine).
    pub margin: f64,
    /// Full-batch AdamW steps.
    pub steps: usize,
    /// Learning rate.
    pub lr: f64,
    /// AdamW weight decay.
    pub weight_decay: f64,
    /// Width of the vectors cosines are taken over (head_dim); must divide the row width.
    pub group: usize,
    /// Seed of the initial weights.
    pub seed: u64,
}

/// A trained MLP substitute on a residual path:
/// `y = x + s · (gelu((x/s) W1 + b1) W2 + b2)`, with `s` the RMS of the
/// training inputs (so training runs at unit scale).
#[derive(Debug, Clone)]
pub struct Mlp {
    /// `[d, hidden]`.
    pub w1: Tensor,
    /// `[hidden]`.
    pub b1: Tensor,
    /// `[hidden, d]`.
    pub w2: Tensor,
    /// `[d]`.
    pub b2: Tensor,
    /// The input scale `s`.
    pub scale: f32,
}

impl Mlp {
    /// Row width.
    pub fn dim(&self) -> usize {
        self.w1.dims()[0]
    }

    /// Hidden width.
    pub fn hidden(&self) -> usize {
        self.w1.dims()[1]
    }

    /// The map applied to rows `x` `[n, d]`.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.to_dtype(DType::F32)?;
        let z = (&x / self.scale as f64)?;
        let d = forward(&z, &self.w1, &self.b1, &self.w2, &self.b2)?;
        Ok((x + (d * self.scale as f64)?)?)
    }
}

fn forward(z: &Tensor, w1: &Tensor, b1: &Tensor, w2: &Tensor, b2: &Tensor) -> Result<Tensor> {
    let h = z.matmul(w1)?.broadcast_add(b1)?.gelu_erf()?;
    Ok(h.matmul(w2)?.broadcast_add(b2)?)
}

/// Per-vector cosines of `a` to `b` (`[n, d]`, vectors of `group`): `[n·d/group]`.
fn group_cosines(a: &Tensor, b: &Tensor, group: usize) -> Result<Tensor> {
    let (n, d) = a.dims2()?;
    let a = a.reshape((n * d / group, group))?;
    let b = b.reshape((n * d / group, group))?;
    let dot = (&a * &b)?.sum(D::Minus1)?;
    let na = a.sqr()?.sum(D::Minus1)?.sqrt()?;
    let nb = b.sqr()?.sum(D::Minus1)?.sqrt()?;
    Ok((dot / ((na * nb)? + 1e-12)?)?)
}

fn loss(pred: &Tensor, y: &Tensor, t: &MlpTraining) -> Result<Tensor> {
    Ok(match t.objective {
        Objective::Mse => (pred - y)?.sqr()?.mean_all()?,
        Objective::Cosine => group_cosines(pred, y, t.group)?
            .affine(-1.0, 1.0)?
            .mean_all()?,
        Objective::Hinge => group_cosines(pred, y, t.group)?
            .affine(-1.0, t.margin)?
            .relu()?
            .mean_all()?,
    })
}

/// Checks an MLP training spec for rows of width `d`.
pub fn validate_mlp(t: &MlpTraining, d: usize) -> Result<()> {
    if t.hidden == 0 {
        return bad("hidden size 0: an MLP needs at least one hidden unit");
    }
    if t.steps == 0 {
        return bad("0 training steps");
    }
    if !(t.lr > 0.0 && t.lr.is_finite()) {
        return bad(format!("learning rate {} is not positive", t.lr));
    }
    if !(t.weight_decay >= 0.0 && t.weight_decay.is_finite()) {
        return bad(format!("weight decay {} is negative", t.weight_decay));
    }
    if !(t.margin > -1.0 && t.margin <= 1.0) {
        return bad(format!("hinge margin {} is not in (-1, 1]", t.margin));
    }
    if t.group == 0 || !d.is_multiple_of(t.group) {
        return bad(format!(
            "vector width {} does not divide rows of {d}",
            t.group
        ));
    }
    Ok(())
}

fn init(rows: usize, cols: usize, std: f64, seed: u64, device: &Device) -> Result<Var> {
    let mut g = Gaussian::new(seed);
    let v: Vec<f32> = (0..rows * cols).map(|_| (g.next() * std) as f32).collect();
    Ok(Var::from_tensor(&Tensor::from_vec(
        v,
        (rows, cols),
        device,
    )?)?)
}

/// Trains an MLP substitute from rows `x` to rows `y` (`[n, d]` each) with
/// full-batch AdamW; returns it and the loss before each step and after the
/// last (`steps + 1` values). Initial weights are drawn from `seed` (the
/// output layer starts at zero: the map starts as the identity).
pub fn train_mlp(x: &Tensor, y: &Tensor, t: &MlpTraining) -> Result<(Mlp, Vec<f32>)> {
    let (n, dx, dy) = check_rows(x, y)?;
    if dx != dy {
        return bad(format!(
            "an MLP substitute maps rows to rows of the same width (got {dx} -> {dy})"
        ));
    }
    validate_mlp(t, dx)?;
    let device = x.device();
    let x = x.to_dtype(DType::F32)?;
    let y = y.to_dtype(DType::F32)?;
    let scale = x.sqr()?.mean_all()?.sqrt()?.to_scalar::<f32>()?;
    let scale = if scale > 0.0 && scale.is_finite() {
        scale
    } else {
        1.0
    };
    let zx = (&x / scale as f64)?;
    let zy = (&y / scale as f64)?;
    let w1 = init(dx, t.hidden, (1.0 / dx as f64).sqrt(), t.seed, device)?;
    let b1 = Var::from_tensor(&Tensor::zeros(t.hidden, DType::F32, device)?)?;
    let w2 = Var::from_tensor(&Tensor::zeros((t.hidden, dx), DType::F32, device)?)?;
    let b2 = Var::from_tensor(&Tensor::zeros(dx, DType::F32, device)?)?;
    let mut opt = AdamW::new(
        vec![w1.clone(), b1.clone(), w2.clone(), b2.clone()],
        ParamsAdamW {
            lr: t.lr,
            weight_decay: t.weight_decay,
            ..ParamsAdamW::default()
        },
    )?;
    let step_loss = || -> Result<Tensor> {
        let pred = (&zx + forward(&zx, &w1, &b1, &w2, &b2)?)?;
        loss(&pred, &zy, t)
    };
    let mut losses = Vec::with_capacity(t.steps + 1);
    for _ in 0..t.steps {
        let l = step_loss()?;
        losses.push(l.to_scalar::<f32>()?);
        opt.backward_step(&l)?;
    }
    losses.push(step_loss()?.to_scalar::<f32>()?);
    if losses.iter().any(|l| !l.is_finite()) {
        return bad(format!("training on {n} rows diverged (a non-finite loss)"));
    }
    Ok((
        Mlp {
            w1: w1.as_tensor().clone(),
            b1: b1.as_tensor().clone(),
            w2: w2.as_tensor().clone(),
            b2: b2.as_tensor().clone(),
            scale,
        },
        losses,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gaussian(n: usize, d: usize, seed: u64) -> Tensor {
        let mut g = Gaussian::new(seed);
        let v: Vec<f32> = (0..n * d).map(|_| g.next() as f32).collect();
        Tensor::from_vec(v, (n, d), &Device::Cpu).unwrap()
    }

    fn max_abs(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar()
            .unwrap()
    }

    #[test]
    fn least_squares_recovers_a_known_affine_map_exactly() {
        let (n, d) = (200, 8);
        let x = gaussian(n, d, 1);
        let w = gaussian(d, d, 2);
        let b = gaussian(1, d, 3).squeeze(0).unwrap();
        let y = x.matmul(&w).unwrap().broadcast_add(&b).unwrap();
        let fit = least_squares(&x, &y, 0.0).unwrap();
        assert!(max_abs(&fit.weight, &w) < 1e-4, "W recovered");
        assert!(max_abs(&fit.bias, &b) < 1e-4, "b recovered");
        assert!(max_abs(&fit.apply(&x).unwrap(), &y) < 1e-4);
        // Ridge shrinks, and stays finite.
        let shrunk = least_squares(&x, &y, 1.0).unwrap();
        let norm = |t: &Tensor| {
            t.sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        assert!(norm(&shrunk.weight) < norm(&fit.weight));
        assert!(least_squares(&x, &y, -1.0).is_err());
        assert!(least_squares(&x, &y.narrow(0, 0, 10).unwrap(), 0.0).is_err());
    }

    #[test]
    fn normal_equations_in_batches_fit_what_least_squares_fits_at_once() {
        let (n, din, dout) = (300, 6, 4);
        // A large common offset, as residual streams have.
        let x = (gaussian(n, din, 11) + 100.0).unwrap();
        let w = gaussian(din, dout, 12);
        let b = gaussian(1, dout, 13).squeeze(0).unwrap();
        let noise = (gaussian(n, dout, 14) * 0.01).unwrap();
        let y = (x.matmul(&w).unwrap().broadcast_add(&b).unwrap() + noise).unwrap();
        let once = least_squares(&x, &y, 1e-3).unwrap();
        let mut ne = NormalEquations::new(din, dout);
        for (lo, len) in [(0, 100), (100, 150), (250, 50)] {
            ne.add(
                &x.narrow(0, lo, len).unwrap(),
                &y.narrow(0, lo, len).unwrap(),
            )
            .unwrap();
        }
        assert_eq!(ne.rows(), n);
        let acc = ne.solve(1e-3, None).unwrap();
        assert!(max_abs(&acc.weight, &once.weight) < 1e-3);
        assert!(max_abs(&acc.apply(&x).unwrap(), &once.apply(&x).unwrap()) < 1e-2);
        // Truncation to rank r leaves a map of rank r.
        let r2 = ne.solve(1e-3, Some(2)).unwrap();
        let m = to_matrix(&r2.weight).unwrap();
        let sv = SVD::new(m, false, false).singular_values;
        assert!(sv[1] > 1e-3 && sv[2] < 1e-4, "{sv:?}");
        // Nearly all variance explained at full rank, less at rank 2.
        let full = ne.explained(&acc).unwrap();
        assert!(full > 0.999, "{full}");
        let part = ne.explained(&r2).unwrap();
        assert!(part < full && part > 0.0, "{part}");
        // Rows of the wrong width are refused.
        assert!(ne.add(&y, &y).is_err());
        assert!(NormalEquations::new(2, 2).solve(0.0, None).is_err());
    }

    #[test]
    fn least_squares_on_fewer_rows_than_dimensions_still_solves() {
        let x = gaussian(4, 8, 5);
        let y = gaussian(4, 8, 6);
        let fit = least_squares(&x, &y, 0.0).unwrap();
        assert!(max_abs(&fit.apply(&x).unwrap(), &y) < 1e-3, "interpolates");
    }

    #[test]
    fn the_subspace_map_writes_only_into_the_offset_column_space_and_is_exact_inside_it() {
        let (hd, dm, n) = (8, 20, 300);
        let wk = gaussian(hd, dm, 7);
        let b = gaussian(1, hd, 8).squeeze(0).unwrap();
        let u = key_subspace(&wk, Some(3)).unwrap();
        assert_eq!(u.dims(), [hd, 3]);
        // Orthonormal columns.
        let utu = u.t().unwrap().matmul(&u).unwrap();
        assert!(max_abs(&utu, &Tensor::eye(3, DType::F32, &Device::Cpu).unwrap()) < 1e-5);
        let x = gaussian(n, hd, 9);
        let y = gaussian(n, hd, 10);
        let fit = least_squares_in_subspace(&x, &y, &u, &b, 0.0).unwrap();
        let out = fit.apply(&gaussian(50, hd, 11)).unwrap();
        // (out - b) has no component outside span(U).
        let r = out.broadcast_sub(&b).unwrap();
        let inside = r.matmul(&u).unwrap().matmul(&u.t().unwrap()).unwrap();
        assert!(max_abs(&r, &inside) < 1e-4, "output in b + span(U)");
        // A map that is linear inside the subspace is recovered exactly.
        let d = gaussian(3, 3, 12);
        let truth = |x: &Tensor| {
            x.broadcast_sub(&b)
                .unwrap()
                .matmul(&u)
                .unwrap()
                .matmul(&d)
                .unwrap()
                .matmul(&u.t().unwrap())
                .unwrap()
                .broadcast_add(&b)
                .unwrap()
        };
        let fit = least_squares_in_subspace(&x, &truth(&x), &u, &b, 0.0).unwrap();
        let probe = gaussian(20, hd, 13);
        assert!(max_abs(&fit.apply(&probe).unwrap(), &truth(&probe)) < 1e-4);
        // Full rank is the numerical rank; more is an error.
        assert_eq!(key_subspace(&wk, None).unwrap().dims(), [hd, hd]);
        assert!(key_subspace(&wk, Some(hd + 1)).is_err());
        assert!(key_subspace(&wk, Some(0)).is_err());
    }

    #[test]
    fn rope_rotation_round_trips_and_preserves_norms() {
        let x = gaussian(6, 8, 14);
        let pos = [0, 1, 5, 17, 100, 3];
        for style in [RopeStyle::Half, RopeStyle::Interleaved] {
            let r = rope_rotate(&x, &pos, 10_000.0, style, false).unwrap();
            let back = rope_rotate(&r, &pos, 10_000.0, style, true).unwrap();
            assert!(max_abs(&back, &x) < 1e-5);
            let n = |t: &Tensor| t.sqr().unwrap().sum(1).unwrap();
            assert!(max_abs(&n(&r), &n(&x)) < 1e-3);
            // Position 0 is the identity.
            assert!(max_abs(&r.narrow(0, 0, 1).unwrap(), &x.narrow(0, 0, 1).unwrap()) < 1e-7);
        }
    }

    #[test]
    fn the_mlp_loss_decreases_under_every_objective() {
        let (n, d) = (128, 8);
        let y = gaussian(n, d, 15);
        // Inputs: targets under a fixed nonlinear distortion plus noise.
        let x = ((y.tanh().unwrap() * 0.8).unwrap() + (gaussian(n, d, 16) * 0.1).unwrap()).unwrap();
        for objective in [Objective::Mse, Objective::Cosine, Objective::Hinge] {
            let t = MlpTraining {
                hidden: 32,
                objective,
                margin: 0.99,
                steps: 60,
                lr: 1e-2,
                weight_decay: 0.0,
                group: 4,
                seed: 3,
            };
            let (mlp, losses) = train_mlp(&x, &y, &t).unwrap();
            assert_eq!(losses.len(), 61);
            let (first, last) = (losses[0], *losses.last().unwrap());
            assert!(last < 0.8 * first, "{objective:?}: {first} -> {last}");
            // Deterministic in its seed.
            let (again, _) = train_mlp(&x, &y, &t).unwrap();
            assert_eq!(
                max_abs(&mlp.apply(&x).unwrap(), &again.apply(&x).unwrap()),
                0.0
            );
            assert_eq!((mlp.dim(), mlp.hidden()), (d, 32));
        }
        let bad_hidden = MlpTraining {
            hidden: 0,
            objective: Objective::Mse,
            margin: 0.99,
            steps: 1,
            lr: 1e-3,
            weight_decay: 0.0,
            group: 4,
            seed: 0,
        };
        assert!(train_mlp(&x, &y, &bad_hidden).is_err());
    }
}
