"""Every test's tier, by file with per-test exceptions; tests/conftest.py marks each collected test with it.

A tier says what a test starts, so a run can pick by cost (`make test-fast`: `-m "unit or engine"`):
  unit          this process only, no model engine (a short `python -c` helper is fine)
  engine        an engine on a tiny checkpoint, in this process (`LLM`, `EngineCore`, `ModelRunner`)
  multiprocess  vlserve processes: servers, roles, an engine process, tensor-parallel ranks; or a helper process
                whose life is the point (it exits, crashes or dies mid-way)
  transport     data between disaggregated roles over each `--transfer-backend` (zmq, shm, mooncake, nixl)
The names are registered as markers in pyproject.toml. A new test file goes into FILE_TIERS, or collection stops
with an error that says so."""

from __future__ import annotations

TIERS = ("unit", "engine", "multiprocess", "transport")

FILE_TIERS = {
    "test_audio_model.py": "unit",
    "test_bench_serve.py": "unit",
    "test_cli.py": "unit",
    "test_cli_messages.py": "unit",
    "test_cpu_budget.py": "unit",
    "test_cpu_kernels.py": "unit",
    "test_detokenizer.py": "unit",
    "test_disagg_auth.py": "unit",
    "test_disagg_bootstrap.py": "unit",
    "test_etcd_cluster.py": "multiprocess",
    "test_etcd_registry.py": "multiprocess",
    "test_kubernetes.py": "unit",
    "test_hostile_peers.py": "unit",
    "test_audio_input.py": "unit",
    "test_image_preprocessing.py": "unit",
    "test_hostile_media.py": "unit",
    "test_llava_processor.py": "unit",
    "test_internvl_processor.py": "unit",
    "test_family_neutral.py": "unit",
    "test_kernel_build.py": "unit",
    "test_newcomer_fixes.py": "unit",
    "test_doc_snippets.py": "unit",
    "test_doc_snippets_run.py": "multiprocess",
    "test_kv_index.py": "unit",
    "test_processed_media_cache.py": "unit",
    "test_router_announce.py": "unit",
    "test_router_choice.py": "unit",
    "test_router_hashes.py": "unit",
    "test_router_hostile.py": "unit",
    "test_http_hosts.py": "unit",
    "test_router.py": "multiprocess",
    "test_run_batch.py": "multiprocess",
    "test_router_disagg.py": "multiprocess",
    "test_layers.py": "unit",
    "test_listen.py": "unit",
    "test_gated_delta.py": "unit",
    "test_qwen3_5_model.py": "unit",
    "test_llava_model.py": "unit",
    "test_model_facts.py": "unit",
    "test_media_fetch.py": "unit",
    "test_media_error_flags.py": "unit",
    "test_mrope.py": "unit",
    "test_omni_layout.py": "unit",
    "test_peer_affinity.py": "unit",
    "test_pixel_cap.py": "unit",
    "test_prefill_attention.py": "unit",
    "test_row_map.py": "unit",
    "test_sampler.py": "unit",
    "test_sampling_params.py": "unit",
    "test_scheduler_units.py": "unit",
    "test_state_cache.py": "unit",
    "test_stream_updates.py": "unit",
    "test_template_sandbox.py": "unit",
    "test_tiers.py": "unit",
    "test_tiny_model.py": "unit",
    "test_tool_calls.py": "unit",
    "test_triton_attention.py": "unit",
    "test_transfer_buffers.py": "unit",
    "test_audio_parity.py": "engine",
    "test_llava_parity.py": "engine",
    "test_internvl_parity.py": "engine",
    "test_lora_parity.py": "engine",
    "test_lora.py": "engine",
    "test_caching.py": "engine",
    "test_kv_events.py": "engine",
    "test_chat_api.py": "engine",
    "test_cpu_paths.py": "engine",
    "test_encode_service.py": "engine",
    "test_encoder_towers.py": "engine",
    "test_engine_errors.py": "engine",
    "test_engine_sampling.py": "engine",
    "test_hardware.py": "engine",
    "test_loader.py": "engine",
    "test_mm_embeds.py": "engine",
    "test_omni_parity.py": "engine",
    "test_packed_linear.py": "engine",
    "test_parity.py": "engine",
    "test_graphs.py": "engine",
    "test_async_scheduling.py": "engine",
    "test_cuda.py": "engine",
    "test_pd_handoff.py": "engine",
    "test_kv_row_writes.py": "engine",
    "test_quantization.py": "engine",
    "test_qwen3_vl.py": "engine",
    "test_qwen3_5_parity.py": "engine",
    "test_qwen3_5_disagg.py": "engine",
    "test_structured_limits.py": "engine",
    "test_structured_outputs.py": "engine",
    "test_video.py": "engine",
    "test_disagg_serve.py": "multiprocess",
    "test_audio_server.py": "multiprocess",
    "test_audio_disagg.py": "multiprocess",
    "test_transcriptions.py": "multiprocess",
    "test_llava_serving.py": "multiprocess",
    "test_internvl_serving.py": "multiprocess",
    "test_lora_server.py": "multiprocess",
    "test_lora_disagg.py": "multiprocess",
    "test_engine_process.py": "multiprocess",
    "test_kv_events_process.py": "multiprocess",
    "test_prompt_ownership.py": "multiprocess",
    "test_process_hygiene.py": "multiprocess",
    "test_kernel_cache_access.py": "multiprocess",
    "test_playground.py": "multiprocess",
    "test_stream_abort.py": "unit",
    "test_readiness.py": "multiprocess",
    "test_server_api.py": "multiprocess",
    "test_server_failures.py": "multiprocess",
    "test_server_hostile.py": "multiprocess",
    "test_structured_limits_server.py": "multiprocess",
    "test_structured_server.py": "multiprocess",
    "test_responses.py": "multiprocess",
    "test_tensor_parallel.py": "multiprocess",
    "test_disagg.py": "transport",
    "test_pd_disagg.py": "transport",
    "test_transports.py": "transport",
}

# "file::test function" (every parametrization of it) whose tier is not its file's.
TEST_TIERS = {
    "test_http_hosts.py::test_served_processes_check_the_host_and_redirect_relatively": "multiprocess",
    "test_disagg_bootstrap.py::test_real_bootstrap_process": "multiprocess",
    "test_hostile_peers.py::test_a_real_registry_answers_a_huge_announced_body_without_waiting_for_it": "multiprocess",
    "test_hostile_peers.py::test_a_deployment_over_shm_survives_its_buffer_file_being_truncated": "transport",
    "test_hostile_peers.py::test_a_truncated_shm_file_is_a_clean_error_then_restored_and_gone_at_exit": "multiprocess",
    "test_hostile_peers.py::test_the_buffer_file_goes_when_its_process_exits_without_unlink": "multiprocess",
    "test_kernel_build.py::test_a_builder_killed_mid_build_leaves_nothing_that_blocks_the_next": "multiprocess",
    "test_quantization.py::test_export_module_entry_has_no_traceback": "multiprocess",
    "test_structured_limits.py::test_deep_grammars_compile_without_crashing_the_process": "multiprocess",
    "test_transfer_buffers.py::test_another_process_maps_the_same_memory_even_after_unlink": "multiprocess",
    "test_pd_disagg.py::test_serve_disagg_runs_e_p_d_in_one_command": "multiprocess",
    "test_qwen3_5_disagg.py::test_e_p_d_processes_hand_over_states_and_match_aggregated": "transport",
    "test_pd_disagg.py::test_e_p_d_roles_share_the_cores_on_one_machine": "unit",
    "test_qwen3_vl.py::test_one_encoder_one_language_server_with_resumes": "multiprocess",
    "test_model_facts.py::test_the_engine_uses_the_facts_it_is_sent_not_the_files": "multiprocess",
    "test_encode_service.py::test_two_ranks_encode_what_one_does": "multiprocess",
    "test_encode_service.py::test_a_tower_the_ranks_cannot_split_is_refused_at_start_naming_the_flags": "multiprocess",
    "test_llava_serving.py::test_int8_loads_and_generates_with_pictures_and_videos": "engine",
    "test_internvl_serving.py::test_int8_loads_and_generates_with_pictures_and_videos": "engine",
    "test_llava_parity.py::test_two_ranks_match_transformers": "multiprocess",
    "test_internvl_parity.py::test_two_ranks_match_transformers": "multiprocess",
}


class MissingTier(LookupError):
    pass


def tier_of(file_name: str, function: str) -> str:
    """The tier of test `function` in tests/`file_name`; MissingTier for a file the table does not know."""
    if f"{file_name}::{function}" in TEST_TIERS:
        return TEST_TIERS[f"{file_name}::{function}"]
    if file_name not in FILE_TIERS:
        raise MissingTier(f"tests/{file_name} has no tier: add it to FILE_TIERS in tests/tiers.py "
                          f"(one of {', '.join(TIERS)}; see the top of that file)")
    return FILE_TIERS[file_name]
