// swift-tools-version:6.0
import PackageDescription

let package = Package(
    name: "keybagfs",
    platforms: [.macOS(.v15)],
    products: [
        .executable(name: "keybagfs", targets: ["keybagfs"]),
        .executable(name: "keybagctl", targets: ["keybagctl"]),
        // Apple's Data Protection API shapes for programs on a keybagfs mount.
        .library(name: "FileProtection", targets: ["FileProtection"]),
    ],
    dependencies: [
        .package(url: "https://github.com/apple/swift-argument-parser", from: "1.5.0"),
        // `swift package generate-documentation --target FileProtection` (DocC).
        .package(url: "https://github.com/swiftlang/swift-docc-plugin", from: "1.5.0"),
    ],
    targets: [
        .systemLibrary(name: "CFuse", path: "Sources/CFuse", pkgConfig: "fuse3",
                       providers: [.apt(["libfuse3-dev"])]),
        .systemLibrary(name: "CSodium", path: "Sources/CSodium", pkgConfig: "libsodium",
                       providers: [.apt(["libsodium-dev"])]),
        // Linux calls and constants that need _GNU_SOURCE.
        .target(name: "CSystem", path: "Sources/CSystem"),
        // Hardware AES for file contents: OpenSSL 3's libcrypto (AES-256-GCM, XAES-256-GCM).
        .target(name: "CCrypto", path: "Sources/CCrypto", linkerSettings: [.linkedLibrary("crypto")]),
        // A TPM 2.0 through tpm2-tss (ESAPI, the TCTI loader): the passcode's sealed secret,
        // the TPM's dictionary-attack lockout, the keybag's NV counter.
        .target(name: "CTPM", path: "Sources/CTPM", linkerSettings: [
            .linkedLibrary("tss2-esys"), .linkedLibrary("tss2-tctildr"), .linkedLibrary("tss2-mu"),
            .linkedLibrary("tss2-rc"), .linkedLibrary("tss2-sys"),
        ]),
        // systemd-logind's signals and sleep inhibitors through sd-bus, for `keybagctl follow`.
        .target(name: "CLogind", path: "Sources/CLogind", linkerSettings: [.linkedLibrary("systemd")]),
        // The control socket's paths, line protocol and client: Foundation and Glibc only.
        .target(name: "KeybagProtocol"),
        // The core: formats, keybag, class rules, lock state. No FUSE here.
        .target(name: "KeybagCore", dependencies: ["CSodium", "CSystem", "CCrypto", "CTPM", "KeybagProtocol"]),
        // The library programs use: FileProtectionType, protected writes, ProtectedData events.
        .target(name: "FileProtection", dependencies: ["KeybagProtocol", "CSystem"]),
        // The example of the library: a notes store that follows the lock.
        .executableTarget(name: "SecureNotes", dependencies: ["FileProtection"], path: "Examples/SecureNotes"),
        // The daemon: FUSE frontend and control socket server.
        .target(name: "KeybagDaemon", dependencies: ["KeybagCore", "KeybagProtocol", "CFuse", "CSodium", "CSystem"]),
        // What both commands share: the contract's exit codes.
        .target(name: "KeybagCLI", dependencies: [
            "KeybagCore",
            .product(name: "ArgumentParser", package: "swift-argument-parser"),
        ]),
        .executableTarget(name: "keybagfs", dependencies: [
            "KeybagDaemon", "KeybagCore", "KeybagCLI",
            .product(name: "ArgumentParser", package: "swift-argument-parser"),
        ]),
        .executableTarget(name: "keybagctl", dependencies: [
            "KeybagCore", "KeybagCLI", "CSystem", "CLogind",
            .product(name: "ArgumentParser", package: "swift-argument-parser"),
        ]),
        // Micro-benchmarks and lock latency; built, not run, in CI.
        .executableTarget(name: "keybagfs-bench", dependencies: ["KeybagCore", "KeybagProtocol", "CSystem", "CSodium", "CCrypto"]),
        // The fuzz targets of every parser of store and socket bytes (Fuzz/, scripts/fuzz.sh):
        // built plainly it replays inputs; built with libFuzzer (-DKBFS_FUZZ) it searches.
        .executableTarget(
            name: "keybagfs-fuzz", dependencies: ["KeybagCore", "KeybagProtocol", "CSodium", "CSystem"],
            path: "Fuzz/Targets"),
        // AES-256 round keys and blocks from OpenSSL, for the tests' memory scans and vectors.
        .target(name: "CTestSupport", path: "Tests/CTestSupport", linkerSettings: [.linkedLibrary("crypto")]),
        .testTarget(name: "KeybagCoreTests", dependencies: ["KeybagCore", "CCrypto", "CSodium", "CTestSupport"]),
        .testTarget(name: "KeybagDaemonTests", dependencies: ["KeybagDaemon", "KeybagCore"]),
        .testTarget(name: "MountTests", dependencies: ["KeybagCore", "KeybagProtocol", "CFuse", "CSystem", "FileProtection", "keybagfs", "keybagctl", "SecureNotes", "CTestSupport", "CCrypto", "CSodium", "CTPM"]),
    ],
    swiftLanguageModes: [.v6]
)
