"""The nodes' TLS material and the cluster's KV MAC keyring reach them from the cloud's secret
store at boot, never through user data, into files only the spotinfer user can read."""

from __future__ import annotations

import pytest

pytest.importorskip("hcl2", reason="python-hcl2 is not installed")

from tests.infra import hcl_properties as hcl
from tests.infra.conftest import BOOT_DIR, TERRAFORM_DIR

FETCH = {
    "aws-boot.sh.tftpl": "aws secretsmanager get-secret-value",
    "gcp-boot.sh.tftpl": "gcloud secrets versions access latest",
}


@pytest.mark.parametrize("template", sorted(FETCH))
def test_the_boot_script_fetches_the_tls_bundle_into_private_files(template: str) -> None:
    text = (BOOT_DIR / template).read_text()
    block = text[text.index("# --- TLS") : text.index("# --- end TLS")]
    assert FETCH[template] in block
    assert "install -d -m 0700 /etc/spotinfer/tls" in block
    assert 'chmod 0600 "/etc/spotinfer/tls/' in block
    assert "BEGIN" not in block  # no PEM is rendered into the script
    for setting in ("TRANSPORT_CA_FILE", "TRANSPORT_CERT_FILE", "TRANSPORT_KEY_FILE"):
        assert f"SPOTINFER_{setting}=/etc/spotinfer/tls/" in block
    assert "SPOTINFER_API_KEYS_FILE=/etc/spotinfer/tls/keys.jsonl" in block


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_the_module_makes_a_secret_per_role_with_names_from_a_variable(cloud: str) -> None:
    module = hcl.load_module(TERRAFORM_DIR / cloud)
    assert "tls_secret_names" in module.variables
    settings = module.locals["boot_settings"]
    prefix = "tls_secret_arn_" if cloud == "aws" else "tls_secret_id_"
    assert {prefix + "coordinator", prefix + "worker"} <= set(settings)


@pytest.mark.parametrize("template", sorted(FETCH))
def test_the_boot_script_fetches_the_kv_mac_keyring_into_a_private_file(template: str) -> None:
    text = (BOOT_DIR / template).read_text()
    block = text[text.index("# --- TLS") : text.index("# --- end TLS")]
    fetch = block[block.index("<<'FETCH'") : block.index("\nFETCH\n")]
    assert '--secret-id "$3"' in fetch if template.startswith("aws") else '--secret="$3"' in fetch
    assert "chmod 0600 /etc/spotinfer/kv-mac.keys.new" in fetch
    assert fetch.index("chmod 0600 /etc/spotinfer/kv-mac.keys.new") < fetch.index(
        "mv -f /etc/spotinfer/kv-mac.keys.new /etc/spotinfer/kv-mac.keys"
    )  # never readable by others, not even for a moment
    secret = "kv_mac_secret_arn" if template.startswith("aws") else "kv_mac_secret_id"
    calls = [line for line in block.splitlines() if "/opt/spotinfer-fetch-tls.sh '" in line]
    assert len(calls) == 2 and all(f"'${{{secret}}}'" in line for line in calls)  # boot, hourly
    # Every role's processes get it (config_source reads SPOTINFER_<FLAG>), not just one's.
    env = block[block.index("<<TLSENV") : block.index("%{ if role")]
    assert "SPOTINFER_KV_MAC_KEY_FILE=/etc/spotinfer/kv-mac.keys" in env


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_the_module_makes_one_kv_mac_secret_the_nodes_read(cloud: str) -> None:
    module = hcl.load_module(TERRAFORM_DIR / cloud)
    assert hcl.check_kv_mac_keyring(module, cloud) == []
    assert "kv_mac_secret_name" in module.variables
