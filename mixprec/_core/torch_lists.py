"""torch.autocast's own op lists, per device type, as data: torch 2.13's, read from its
dispatcher (a test checks them). The engine installs a kernel only where the cast table's rule
differs from these, and behaves as torch outside mixprec regions. Rules: ``"lower"``, ``"fp32"``
(torch's "fp32_set_opt_dtype" ops such as ``sum`` included), ``"promote"``, ``"banned"``.
"""

from __future__ import annotations

__all__ = ["TORCH_AUTOCAST", "torch_rule"]


def _rules(**groups: str) -> dict[str, str]:
    return {name: rule for rule, names in groups.items() for name in names.split()}


_CPU = _rules(
    lower="""_addmm_activation _convolution _native_multi_head_attention addbmm addmm baddbmm bmm
        conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d
        linalg_vecdot linear matmul mkldnn_rnn_layer mm prelu scaled_dot_product_attention""",
    promote="cat stack index_copy",
    fp32="""_grid_sampler_2d_cpu_fallback _lu_with_info adaptive_avg_pool3d adaptive_max_pool3d
        avg_pool3d binary_cross_entropy binary_cross_entropy_with_logits cdist cholesky
        cholesky_inverse cholesky_solve cosine_embedding_loss cross_entropy_loss ctc_loss
        fake_quantize_per_tensor_affine fft_fft fft_fft2 fft_fftn fft_hfft fft_ifft fft_ifft2
        fft_ifftn fft_ihfft fft_irfft fft_irfft2 fft_irfftn fft_rfft fft_rfft2 fft_rfftn
        fractional_max_pool2d fractional_max_pool3d geqrf grid_sampler grid_sampler_2d
        grid_sampler_3d hinge_embedding_loss huber_loss inverse kl_div l1_loss linalg_cholesky
        linalg_cholesky_ex linalg_cond linalg_eig linalg_eigh linalg_eigvals linalg_eigvalsh
        linalg_householder_product linalg_inv linalg_inv_ex linalg_lstsq linalg_matrix_rank
        linalg_qr linalg_solve linalg_svd linalg_svdvals linalg_tensorinv linalg_tensorsolve
        lu_solve margin_ranking_loss max_pool3d max_unpool2d max_unpool3d mse_loss
        multi_margin_loss multilabel_margin_loss multilabel_margin_loss_forward nanquantile
        nll_loss nll_loss2d orgqr ormqr pinverse poisson_nll_loss polar prod qr quantile
        reflection_pad1d reflection_pad2d replication_pad1d replication_pad2d replication_pad3d
        smooth_l1_loss soft_margin_loss stft svd trace triangular_solve triplet_margin_loss
        view_as_complex""",
)

_CUDA = _rules(
    lower="""_convolution _scaled_dot_product_flash_attention _thnn_fused_gru_cell
        _thnn_fused_lstm_cell addbmm addmm addmv addr baddbmm bmm chain_matmul conv1d conv2d
        conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d convolution
        cudnn_convolution cudnn_convolution_transpose einsum gru_cell linalg_multi_dot
        linalg_vecdot linear lstm_cell matmul mm mv prelu rnn_relu_cell rnn_tanh_cell
        scaled_dot_product_attention""",
    promote="addcdiv addcmul atan2 bilinear cross dot grid_sampler index_put scatter_add "
    "tensordot vdot",
    banned="binary_cross_entropy",
    fp32="""_upsample_bicubic2d_aa _upsample_bilinear2d_aa _upsample_nearest_exact1d
        _upsample_nearest_exact2d _upsample_nearest_exact3d acos asin
        binary_cross_entropy_with_logits cdist cosh cosine_embedding_loss cosine_similarity
        cumprod cumsum dist erfinv exp expm1 frobenius_norm group_norm hinge_embedding_loss
        huber_loss kl_div l1_loss layer_norm linalg_matrix_norm linalg_vector_norm log log10
        log1p log2 log_softmax logsumexp margin_ranking_loss mse_loss multi_margin_loss
        multilabel_margin_loss native_layer_norm nll_loss nll_loss2d norm nuclear_norm pdist
        poisson_nll_loss pow prod reciprocal renorm rms_norm rsqrt sinh smooth_l1_loss
        soft_margin_loss softmax softplus sum tan triplet_margin_loss upsample_bicubic2d
        upsample_bilinear2d upsample_linear1d upsample_nearest1d upsample_nearest2d
        upsample_nearest3d upsample_trilinear3d""",
)

TORCH_AUTOCAST: dict[str, dict[str, str]] = {"cpu": _CPU, "cuda": _CUDA}
"""``{device type: {aten op name: rule}}`` for every op torch.autocast handles."""


def torch_rule(device_type: str, name: str) -> str | None:
    """torch.autocast's rule for aten op ``name`` on ``device_type``; None when it has none."""
    return TORCH_AUTOCAST.get(device_type, {}).get(name)
