"""The TLS settings of the router and the control plane: off by default, and every file
checked at load, with errors that name the field."""

from __future__ import annotations

import pytest

from extproc.config import RouterConfig, load_config
from extproc.control.config import ControlPlaneConfig, load_control_plane_config
from extproc.errors import ConfigError

from .tls_certs import Pki, make_pki

CONTROL_PLANE = "127.0.0.1:18000"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def router(**settings) -> RouterConfig:
    return load_config(env={}, overrides={k: str(v) for k, v in settings.items()})


def control_plane(**settings) -> ControlPlaneConfig:
    return load_control_plane_config(None, {k: str(v) for k, v in settings.items()})


def test_tls_is_off_by_default():
    config = RouterConfig()
    assert config.tls_cert_file is config.tls_client_ca_file is config.control_plane_ca_file
    assert config.tls_cert_file is None
    assert ControlPlaneConfig().tls_cert_file is None


def test_router_takes_mtls_on_both_of_its_links(pki: Pki):
    config = router(
        tls_cert_file=pki.router.cert,
        tls_key_file=pki.router.key,
        tls_client_ca_file=pki.ca,
        control_plane=CONTROL_PLANE,
        control_plane_ca_file=pki.ca,
        control_plane_cert_file=pki.router_client.cert,
        control_plane_key_file=pki.router_client.key,
        control_plane_server_name="control-plane.test",
    )
    assert config.tls_client_ca_file == str(pki.ca)
    assert config.control_plane_server_name == "control-plane.test"


def test_router_tls_settings_come_from_the_environment(pki: Pki):
    env = {
        "PREFIX_ROUTER_TLS_CERT_FILE": str(pki.router.cert),
        "PREFIX_ROUTER_TLS_KEY_FILE": str(pki.router.key),
        "PREFIX_ROUTER_TLS_CLIENT_CA_FILE": "off",
    }
    config = load_config(env=env)
    assert (config.tls_cert_file, config.tls_client_ca_file) == (str(pki.router.cert), None)


def test_control_plane_takes_mtls(pki: Pki):
    config = control_plane(
        tls_cert_file=pki.control_plane.cert,
        tls_key_file=pki.control_plane.key,
        tls_client_ca_file=pki.ca,
    )
    assert config.tls_key_file == str(pki.control_plane.key)


def _missing(pki: Pki) -> str:
    return str(pki.ca.parent / "missing.pem")


@pytest.mark.parametrize("load", [router, control_plane], ids=["router", "control-plane"])
@pytest.mark.parametrize("field", ["tls_cert_file", "tls_key_file", "tls_client_ca_file"])
def test_a_file_that_does_not_exist_is_named(pki: Pki, load, field):
    settings = {
        "tls_cert_file": pki.router.cert,
        "tls_key_file": pki.router.key,
        "tls_client_ca_file": pki.ca,
        field: _missing(pki),
    }
    with pytest.raises(ConfigError) as caught:
        load(**settings)
    assert caught.value.field == field
    assert "readable PEM file" in caught.value.allowed
    assert "No such file" in caught.value.allowed


@pytest.mark.parametrize(
    ("path", "reason"),
    [("{dir}", "Is a directory"), ("{key}/inside.pem", "Not a directory")],
    ids=["a-directory", "under-a-file"],
)
def test_a_path_that_cannot_be_read_is_named(pki: Pki, path, reason):
    # (A file without read permission is not tried: CI runs as root, who reads it.)
    unreadable = path.format(dir=pki.ca.parent, key=pki.router.key)
    with pytest.raises(ConfigError) as caught:
        router(tls_cert_file=pki.router.cert, tls_key_file=unreadable)
    assert caught.value.field == "tls_key_file"
    assert reason in caught.value.allowed


def test_a_file_that_is_not_pem_is_named(pki: Pki, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a certificate\n")
    with pytest.raises(ConfigError) as caught:
        control_plane(
            tls_cert_file=pki.router.cert, tls_key_file=pki.router.key, tls_client_ca_file=text
        )
    assert caught.value.field == "tls_client_ca_file"
    assert "PEM" in caught.value.allowed


@pytest.mark.parametrize("load", [router, control_plane], ids=["router", "control-plane"])
@pytest.mark.parametrize(
    ("given", "missing"), [("tls_cert_file", "tls_key_file"), ("tls_key_file", "tls_cert_file")]
)
def test_a_certificate_needs_its_key_and_the_reverse(pki: Pki, load, given, missing):
    with pytest.raises(ConfigError) as caught:
        load(**{given: pki.router.cert if given == "tls_cert_file" else pki.router.key})
    assert caught.value.field == missing
    assert given in caught.value.allowed


def test_a_key_of_another_certificate_is_refused(pki: Pki):
    with pytest.raises(ConfigError) as caught:
        router(tls_cert_file=pki.router.cert, tls_key_file=pki.envoy.key)
    assert caught.value.field == "tls_key_file"
    assert "private key of the certificate" in caught.value.allowed


def test_a_key_where_the_ca_belongs_is_refused(pki: Pki):
    with pytest.raises(ConfigError) as caught:
        router(
            tls_cert_file=pki.router.cert,
            tls_key_file=pki.router.key,
            tls_client_ca_file=pki.router.key,
        )
    assert caught.value.field == "tls_client_ca_file"
    assert "CA certificates" in caught.value.allowed


@pytest.mark.parametrize("load", [router, control_plane], ids=["router", "control-plane"])
def test_a_client_ca_needs_a_server_certificate(pki: Pki, load):
    with pytest.raises(ConfigError) as caught:
        load(tls_client_ca_file=pki.ca)
    assert caught.value.field == "tls_client_ca_file"
    assert "tls_cert_file" in caught.value.allowed


def test_no_tls_on_a_unix_socket(pki: Pki, tmp_path):
    with pytest.raises(ConfigError) as caught:
        router(
            listen=f"unix:{tmp_path}/r.sock",
            tls_cert_file=pki.router.cert,
            tls_key_file=pki.router.key,
        )
    assert caught.value.field == "tls_cert_file"
    assert "Unix socket" in caught.value.allowed


@pytest.mark.parametrize(
    ("settings", "field", "needs"),
    [
        ({"control_plane_ca_file": "ca"}, "control_plane_ca_file", "control_plane"),
        (
            {"control_plane": CONTROL_PLANE, "control_plane_server_name": "cp.test"},
            "control_plane_server_name",
            "control_plane_ca_file",
        ),
        (
            {
                "control_plane": CONTROL_PLANE,
                "control_plane_cert_file": "cert",
                "control_plane_key_file": "key",
            },
            "control_plane_cert_file",
            "control_plane_ca_file",
        ),
        (
            {
                "control_plane": CONTROL_PLANE,
                "control_plane_ca_file": "ca",
                "control_plane_cert_file": "cert",
            },
            "control_plane_key_file",
            "control_plane_cert_file",
        ),
    ],
)
def test_router_xds_client_settings_go_together(pki: Pki, settings, field, needs):
    files = {"ca": pki.ca, "cert": pki.router_client.cert, "key": pki.router_client.key}
    resolved = {k: files.get(v, v) if k.endswith("_file") else v for k, v in settings.items()}
    with pytest.raises(ConfigError) as caught:
        router(**resolved)
    assert caught.value.field == field
    assert needs in caught.value.allowed


def test_an_edit_to_the_tls_files_needs_a_restart():
    from extproc.adapter.service import ConfigReloader
    from extproc.control.fleet import RESTART_FIELDS

    tls_fields = [name for name in RouterConfig.model_fields if "tls" in name or "_file" in name]
    assert set(tls_fields) | {"control_plane_server_name"} <= set(ConfigReloader.RESTART_FIELDS)
    assert {"tls_cert_file", "tls_key_file", "tls_client_ca_file"} <= set(RESTART_FIELDS)
