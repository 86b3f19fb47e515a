import Foundation

/// A device's two public keys, base64: X25519 (key sets are sealed to it) and Ed25519 (its
/// records are signed with it), as a certificate, a record or a keybag's trust list holds them.
public struct DevicePublicKeys: Codable, Sendable, Equatable {
    /// X25519, base64.
    public var box: String
    /// Ed25519, base64.
    public var sign: String

    /// The X25519 key (empty when malformed).
    public var boxKey: [UInt8] { Data(base64Encoded: box).map([UInt8].init) ?? [] }
    /// The Ed25519 key (empty when malformed).
    public var signKey: [UInt8] { Data(base64Encoded: sign).map([UInt8].init) ?? [] }
    /// Whether both are 32-byte keys.
    public var isWellFormed: Bool { boxKey.count == 32 && signKey.count == 32 }

    /// `box|sign`: how a signed message or a MAC covers them.
    var joined: String { box + "|" + sign }
}
