import Foundation
import Glibc

/// The extended attribute that holds a file's (or a directory's default) class on a
/// keybagfs mount.
public let protectionAttribute = "user.protection"

extension FileProtectionType {
    /// The class's name in keybagfs (`user.protection`): `none`, `complete`,
    /// `completeUnlessOpen` or `completeUntilFirstUserAuthentication`.
    public var keybagfsName: String? {
        switch rawValue {
        case FileProtectionType.none.rawValue: return "none"
        case FileProtectionType.complete.rawValue: return "complete"
        case FileProtectionType.completeUnlessOpen.rawValue: return "completeUnlessOpen"
        case FileProtectionType.completeUntilFirstUserAuthentication.rawValue:
            return "completeUntilFirstUserAuthentication"
        default: return nil
        }
    }

    /// The protection type of a keybagfs class name (or of an Apple constant).
    public init?(keybagfsName name: String) {
        for t in [FileProtectionType.none, .complete, .completeUnlessOpen, .completeUntilFirstUserAuthentication]
        where t.keybagfsName == name || t.rawValue == name {
            self = t
            return
        }
        return nil
    }
}

extension Data.WritingOptions {
    /// The protection type asked for by the file protection options, if any. (They are
    /// values in the four-bit `fileProtectionMask` field, not independent flags.)
    public var fileProtection: FileProtectionType? {
        switch rawValue & Data.WritingOptions.fileProtectionMask.rawValue {
        case Data.WritingOptions.noFileProtection.rawValue: return FileProtectionType.none
        case Data.WritingOptions.completeFileProtection.rawValue: return .complete
        case Data.WritingOptions.completeFileProtectionUnlessOpen.rawValue: return .completeUnlessOpen
        case Data.WritingOptions.completeFileProtectionUntilFirstUserAuthentication.rawValue:
            return .completeUntilFirstUserAuthentication
        default: return nil
        }
    }
}

/// Builds the Foundation error a file operation on a keybagfs mount answers with.
enum ProtectionErrors {
    /// Key in `userInfo`: true when the error is EACCES from a class whose key is evicted
    /// (the device is locked), not from file permissions.
    static let unavailableKey = "KeybagfsProtectedDataUnavailable"

    /// The error of a call given a protection it cannot apply to `path` (an unknown type, a
    /// `.protectionKey` that is not one), as Foundation reports an invalid file name.
    static func invalidArgument(path: String, _ message: String) -> CocoaError {
        CocoaError(
            .fileWriteInvalidFileName, userInfo: [NSFilePathErrorKey: path, NSLocalizedDescriptionKey: message])
    }

    /// Maps `errno` of an operation on `path` (`writing` or reading) to a `CocoaError`;
    /// `classOf`: where the class that may have denied it is read (default `path`).
    static func error(_ code: Int32, path: String, writing: Bool, what: String, classOf: String? = nil) -> CocoaError {
        var info: [String: Any] = [
            NSFilePathErrorKey: path,
            NSUnderlyingErrorKey: NSError(domain: NSPOSIXErrorDomain, code: Int(code)),
        ]
        let reason = String(cString: strerror(code))
        let cocoa: CocoaError.Code
        switch code {
        case EACCES, EPERM:
            cocoa = writing ? .fileWriteNoPermission : .fileReadNoPermission
            if code == EACCES, ProtectedData.isLockedClassDenial(path: classOf ?? path) {
                info[unavailableKey] = true
                info[NSLocalizedDescriptionKey] =
                    "\(what) \(path): protected data is not available (the device is locked and the file's class "
                    + "needs its key)"
            } else {
                info[NSLocalizedDescriptionKey] = "\(what) \(path): \(reason)"
            }
        case ENOENT:
            cocoa = writing ? .fileNoSuchFile : .fileReadNoSuchFile
            info[NSLocalizedDescriptionKey] = "\(what) \(path): \(reason)"
        case ENOSPC, EDQUOT:
            cocoa = .fileWriteOutOfSpace
            info[NSLocalizedDescriptionKey] = "\(what) \(path): \(reason)"
        case EROFS:
            cocoa = .fileWriteVolumeReadOnly
            info[NSLocalizedDescriptionKey] = "\(what) \(path): \(reason)"
        case EEXIST:
            cocoa = .fileWriteFileExists
            info[NSLocalizedDescriptionKey] = "\(what) \(path): \(reason)"
        case ENOTSUP, ENODATA:
            cocoa = .featureUnsupported
            info[NSLocalizedDescriptionKey] = "\(what) \(path): not on a keybagfs mount (no \(protectionAttribute))"
        default:
            cocoa = writing ? .fileWriteUnknown : .fileReadUnknown
            info[NSLocalizedDescriptionKey] = "\(what) \(path): \(reason)"
        }
        return CocoaError(cocoa, userInfo: info)
    }
}

extension CocoaError {
    /// True when the error is a class whose key is evicted while the device is locked.
    public var isProtectedDataUnavailable: Bool { (userInfo[ProtectionErrors.unavailableKey] as? Bool) == true }
}
